"""Behaviour of the block pool (engine/block_manager.py) and the scheduler (engine/scheduler.py) that
only a planted bug showed untested: each test here fails on a mutant that the other tests let
through (scripts/mutation.py, issue 20)."""
from __future__ import annotations
