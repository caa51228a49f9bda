# An application's Alembic configuration that also applies sqlalchemy-pgtask's revisions.

[alembic]
# path to migration scripts.
# this is typically a path given in POSIX (e.g. forward slashes)
# format, relative to the token %(here)s which refers to the location of this
# ini file
script_location = ${script_location}

# template used to generate migration file names; The default value is %%(rev)s_%%(slug)s
# see https://alembic.sqlalchemy.org/en/latest/tutorial.html#editing-the-ini-file
# for all available tokens
# file_template = %%(year)d_%%(month).2d_%%(day).2d_%%(hour).2d%%(minute).2d-%%(rev)s_%%(slug)s

# sys.path path, will be prepended to sys.path if present.
# defaults to the current working directory.  for multiple paths, the path separator
# is defined by "path_separator" below.
prepend_sys_path = .

# timezone to use when rendering the date within the migration file
# as well as the filename.
# timezone =

# set to 'true' to run the environment during the 'revision' command, regardless
# of autogenerate. It is on so that env.py's process_revision_directives hook also
# sees a plain "alembic revision": it makes your first revision the root of your own
# branch, written into your versions folder, rather than a child of pgtask's head
# written into the installed sqlalchemy_pgtask package. The price: "alembic revision"
# connects to the database. If you turn it off, create your first revision with
# "--head base --version-path <your versions folder>".
revision_environment = true

# Where revisions are read from: your own (first line, where "alembic revision"
# writes) and sqlalchemy-pgtask's, read from the installed package (its branch
# "pgtask"). Because pgtask is a separate branch, apply with
# "alembic upgrade heads" (plural).
version_locations =
    ${script_location}/versions
    sqlalchemy_pgtask:migrations/versions

# path_separator splits version_locations and prepend_sys_path. It is "newline"
# here, not "os": on POSIX "os" means ":", which would split the package location
# "sqlalchemy_pgtask:migrations/versions" in two, and "space" would break on a
# project path that contains a space.
path_separator = newline

# set to 'true' to search source files recursively
# in each "version_locations" directory
# recursive_version_locations = false

# the output encoding used when revision files
# are written from script.py.mako
# output_encoding = utf-8

# database URL, consumed by env.py only. The environment variable DATABASE_URL,
# when set, overrides it (so this file need not hold a password). pgtask needs
# PostgreSQL: "postgresql+psycopg://" names the psycopg (3) driver that
# sqlalchemy-pgtask installs; with SQLAlchemy 2.0 a bare "postgresql://" means psycopg2.
sqlalchemy.url = postgresql+psycopg://user:pass@localhost/dbname


[post_write_hooks]
# post_write_hooks defines scripts or Python functions that are run
# on newly generated revision scripts.  See the documentation for further
# detail and examples

# lint with attempts to fix using "ruff" - use the module runner, against the "ruff" module
# hooks = ruff
# ruff.type = module
# ruff.module = ruff
# ruff.options = check --fix REVISION_SCRIPT_FILENAME

# Logging configuration.  This is also consumed by the user-maintained
# env.py script only.
[loggers]
keys = root,sqlalchemy,alembic

[handlers]
keys = console

[formatters]
keys = generic

[logger_root]
level = WARNING
handlers = console
qualname =

[logger_sqlalchemy]
level = WARNING
handlers =
qualname = sqlalchemy.engine

[logger_alembic]
level = INFO
handlers =
qualname = alembic

[handler_console]
class = StreamHandler
args = (sys.stderr,)
level = NOTSET
formatter = generic

[formatter_generic]
format = %(levelname)-5.5s [%(name)s] %(message)s
datefmt = %H:%M:%S
