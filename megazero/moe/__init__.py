"""Mixture of Experts and expert parallelism: the config (:mod:`.config`), the router
(:mod:`.router`), the token dispatchers over the EP group (:mod:`.dispatch`), the routed experts
split over expert TP (:mod:`.experts`) and the block that replaces a layer's MLP (:mod:`.layer`).
Knows no training loop, checkpoint file or flag; the model hands it its config and its shared
expert. The variable-size collectives are :mod:`megazero.parallel.exchange`'s; the expert grid is
:class:`megazero.parallel.topology.Topology`'s; the memory arithmetic is the planner's."""
