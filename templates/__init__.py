"""Planning: the plan contract, schedules as data, the cost model, stage partitioning and
the planner's templates.

Imports nothing else of Planaria. Only the profiler (`profiler.py` and the two modules
it uses, `gloo_links.py` and `profile_cache.py`) imports torch, and nothing else here
imports it, so a plan can be made, checked and stored anywhere, even on a laptop
without torch.
"""
