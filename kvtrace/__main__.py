from kvtrace.cli import run

run()
