"""`planaria simulate`: replay preemption traces at cluster scale through the real planner
and cost model, and compare recovery policies (Planaria in place, checkpoint-restart,
Bamboo-style redundancy) on the same trace. See docs/simulator.md.
"""
