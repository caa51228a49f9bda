"""Shared test configuration.

Database fixtures come from the ``sqlalchemy_pgtask.testing`` plugin, which the package
registers with pytest (entry point ``pytest11``), exactly as users of the library get them.
"""
