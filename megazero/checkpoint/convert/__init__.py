"""Conversions between megazero's model and other tools' checkpoints: Hugging Face ``transformers``
folders (:mod:`.hf`, :mod:`.hf_moe`) and Megatron-LM's ``torch`` checkpoints (:mod:`.megatron`,
:mod:`.megatron_moe`, :mod:`.megatron_pickle`). ``tools/convert_checkpoint.py`` is their command line."""
