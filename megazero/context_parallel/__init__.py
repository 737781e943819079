"""Context parallelism: the sequence split over CP ranks (load-balanced chunks), ring (p2p)
attention and all-to-all (Ulysses) attention (:mod:`.attention`). Knows no model, loop, checkpoint
or flag: it takes tensors and a process group. Its memory arithmetic for a GPT is the planner's
(:mod:`megazero.planner.cp_memory`)."""
