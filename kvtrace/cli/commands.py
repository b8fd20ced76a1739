"""Every command registered on the app (`kvtrace.cli.load()`): `import kvtrace.cli.commands` in
tests and scripts that drive `kvtrace.cli.app.app` in process."""
from kvtrace.cli import load

load()
