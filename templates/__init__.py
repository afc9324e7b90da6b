"""Planning: the plan contract, schedules as data, and (later) the cost model and templates.

Imports nothing else of Planaria and nothing of torch, so a plan can be made,
checked and stored anywhere, even on a laptop without torch.
"""
