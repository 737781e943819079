"""Context parallelism: the sequence split over CP ranks in load-balanced chunks (:mod:`.chunks`),
ring (p2p) attention (:mod:`.ring`) and all-to-all (Ulysses) attention (:mod:`.ulysses`). Knows no
model, loop, checkpoint or flag: it takes tensors and a process group. Its memory arithmetic for a
GPT is the planner's (:mod:`megazero.planner.cp_memory`)."""
