"""parallel.fault_tolerant: replicas of one process each, each its own world, averaged over the
quorum of live ones at every step (torchft's Lighthouse and Manager, our own smaller code).
launcher.py is the launcher half (the coordination store, one process per replica, a dead one
restarted); quorum.py the worker half (the round's quorum, its gloo group, commit or retry).
The training run's use of them (the step's average, the state a rejoining replica receives) is
train/fault_tolerance.py.

Collectives: the gradient all-reduce and the state broadcast over the quorum's group, in quorum.py."""
