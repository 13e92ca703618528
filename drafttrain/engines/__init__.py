"""Serving engines run for real against drafttrain's exports (the engine test tier, scripts/check_engine.py).

``vllm_driver.py`` runs inside the engine venv (scripts/make_engine_venv.sh) as a plain script; ``vllm_check.py`` is
the main environment's side: the venv's location, the driver call, drafttrain's own decode of the same prompts
and the per-prompt comparison.
"""
