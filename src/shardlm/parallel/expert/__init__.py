"""Expert parallelism: each MoE block's experts cut over the ep group, tokens sent to their
experts' ranks and back (dispatch.py: apply_ep, the all-to-all dispatcher), and hot experts
re-placed by measured load (balance.py).

Collectives: the uneven all-to-all of tokens (and its counts) in dispatch.py; the load
all-reduce and the experts' moves in balance.py."""
