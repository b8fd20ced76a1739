"""`kvtrace COMMAND` imports only COMMAND's module (kvtrace/cli/__init__.py: a command's start-up
pays for no other's imports), and that module registers COMMAND whole: the same subcommands and
options as when every module is loaded, as the help shows them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli import COMMAND_MODULES, MODULES
from kvtrace.cli.app import app

# what a command's module brings besides itself
ALSO = {"capture": {"kvtrace.cli.capture_live"}}

SHAPE = """
import json, sys
import typer
from kvtrace.cli import load

def shape(command):
    if hasattr(command, "commands"):
        return {name: shape(sub) for name, sub in sorted(command.commands.items())}
    return sorted(p.name for p in command.params)

group = typer.main.get_command(load(sys.argv[1]))
print(json.dumps({"commands": {name: shape(group.commands[name]) for name in sys.argv[2:]},
                  "modules": sorted(m for m in sys.modules if m.startswith("kvtrace.cli."))}))
"""


def shape(command):
    if hasattr(command, "commands"):
        return {name: shape(sub) for name, sub in sorted(command.commands.items())}
    return sorted(p.name for p in command.params)


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
