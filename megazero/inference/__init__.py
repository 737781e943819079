"""Inference: the KV cache (:mod:`.cache`), generation (:mod:`.generation`), Megatron's REST
server (:mod:`.serving`) and ``megazero.load_model`` (:mod:`.load_model`: a checkpoint of any
layout as one module)."""
