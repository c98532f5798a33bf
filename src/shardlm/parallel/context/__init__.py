"""Context parallelism: each sequence cut over the cp group (load-balanced halves), attention by
ring, by Ulysses' all-to-all over heads, or both (attention.py: apply_cp by parallel.cp_mode).

Collectives: the ring's key/value hops and Ulysses' all-to-all, as torch custom ops in ops.py
(ulysses.py arranges the heads around the all-to-all; ring_blocks.py is each hop's kernel, no
communication)."""
