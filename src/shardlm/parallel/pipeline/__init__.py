"""Pipeline parallelism: the model's blocks cut into contiguous stages over the pp group, micro-
batches flowing through them (stages.py: apply_pp and a stage's sends and receives; executor.py:
the one schedule executor), the zero-bubble split backward (weight_grads.py), and the schedules
as data (tables.py, schedules.py).

Collectives: stage-to-stage sends and receives of activations and gradients, in stages.py.
tables.py and schedules.py are pure Python without torch, pinned at the config layer
(tests/test_layers.py): config's rules read them. This __init__ imports nothing, so they stay light."""
