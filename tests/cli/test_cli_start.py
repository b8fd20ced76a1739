"""`kvtrace COMMAND` imports only COMMAND's module (kvtrace/cli/__init__.py: a command's start-up
pays for no other's imports), and that module registers COMMAND whole: the same subcommands and
options as when every module is loaded, as the help shows them."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import typer

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli import COMMAND_MODULES, MODULES
from kvtrace.cli.app import app

# what a command's module brings besides itself
ALSO = {"capture": {"kvtrace.cli.capture_live"}}

def shape(command):
    """A command's subcommands and options, as names."""
    if hasattr(command, "commands"):
        return {name: shape(sub) for name, sub in sorted(command.commands.items())}
    return sorted(p.name for p in command.params)


# in a fresh process: the commands' shapes with one command's module loaded, and the CLI modules imported
SHAPE = f"""
import json, sys
import typer
from kvtrace.cli import load

{inspect.getsource(shape)}
group = typer.main.get_command(load(sys.argv[1]))
print(json.dumps({{"commands": {{name: shape(group.commands[name]) for name in sys.argv[2:]}},
                  "modules": sorted(m for m in sys.modules if m.startswith("kvtrace.cli."))}}))
"""


def test_every_command_has_its_module_listed():
    registered = set(typer.main.get_command(app).commands)
    assert registered == set(COMMAND_MODULES)
    assert set(COMMAND_MODULES.values()) == set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_a_command_started_alone_imports_its_module_only_and_is_whole(module):
    names = sorted(name for name, m in COMMAND_MODULES.items() if m == module)
    full = typer.main.get_command(app)
    result = subprocess.run([sys.executable, "-c", SHAPE, names[0], *names], capture_output=True, text=True,
                            check=True)
    alone = json.loads(result.stdout)
    assert alone["modules"] == sorted({"kvtrace.cli.app", f"kvtrace.cli.{module}", *ALSO.get(module, ())})
    assert alone["commands"] == {name: shape(full.commands[name]) for name in names}


# the process's entry as the `kvtrace` script runs it, with an atexit handler and, if asked, a thread
# still running when the command is done (it waits for the main thread to end)
ENTRY = """
import atexit, sys, threading
from kvtrace.cli import run
atexit.register(lambda: print("atexit handler ran"))   # left in stdout's buffer: run must flush it
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: (threading.main_thread().join(), print("thread done"))).start()
sys.argv = ["kvtrace", *sys.argv[2:]]
run()
"""


@pytest.mark.parametrize("thread", ["none", "thread"])
@pytest.mark.parametrize("args, status, shown", [
    (["--help"], 0, "Record a replay"),
    (["workload", "check", "/nonexistent/w.jsonl"], 2, "kvtrace: error: workload file not found"),
    (["no-such-command"], 2, "No such command"),
])
def test_the_entry_exits_with_the_commands_status_its_output_whole_and_its_atexit_handlers_run(
        tmp_path, thread, args, status, shown):
    """`run` skips the interpreter's teardown, not the exit's work: the status, every line written
    (piped, so buffered), the atexit handlers; and with another thread running it waits for it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}   # stdout a buffered pipe
    done = subprocess.run([sys.executable, "-c", ENTRY, thread, *args], capture_output=True, text=True, cwd=tmp_path,
                          env=env)
    assert done.returncode == status, done.stderr
    assert shown in done.stdout + done.stderr
    # as at any exit: the other threads finish, then the atexit handlers run
    ending = ["thread done", "atexit handler ran"] if thread == "thread" else ["atexit handler ran"]
    assert done.stdout.rstrip().splitlines()[-len(ending):] == ending
