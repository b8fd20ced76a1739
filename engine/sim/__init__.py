"""The simulated engine's own parts: its executor and cost model, and its fast path.

- executor.py: `SimExecutor`, the Executor of `--engine sim`: runs nothing, predicts each step's time
  from cost_model.py (a hardware profile: built-in, or calibrated into profiles/), in virtual time.
- fast_path.py: the loop's decisions made cheaper where most simulated steps are plain decodes,
  behind one seam (`LLMEngine.fast_path`): leaps (leap.py) and lazy steps (cohort.py),
  both built on a plain decode's block work (decodes.py).

Every KV decision is still the core's (engine/scheduler.py, engine/block_manager.py): the fast path
makes the same ones, which tests/engine/test_fast_path.py checks against the general pass. The core
imports nothing from here (tests/tools/test_layering.py).
"""
