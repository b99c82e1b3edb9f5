"""Model-parallel embedding tables: placement planner, collectives, and the layer that executes a plan."""
