"""Helpers shared by the test suites (integration, acceptance): one place for each."""
