"""The checkpoint format's one owner: names, index entries that survive a JSON round trip (the
exact-resume test compares them), readable versions, and the saved RNG state."""

import json
import random

import numpy as np
import pytest
import torch

from megazero.checkpoint import schema
from megazero.checkpoint.rng import restore_rng, rng_state
from megazero.tensor_parallel.spec import TPSplit


def test_paths():
    assert schema.iteration_dir("/r", 100) == "/r/iter_0000100"
    assert schema.rank_file("/r/iter_0000100", 5) == "/r/iter_0000100/rank_00005.pt"
    assert schema.metadata_file("/d") == "/d/metadata.json"
    assert schema.latest_file("/r") == "/r/latest_checkpointed_iteration.txt"


@pytest.mark.parametrize("split", [None, TPSplit(0), TPSplit(0, (16, 8, 8)), TPSplit(1, None, 100)])
def test_param_entry_round_trip(split):
    entry = schema.ParamEntry(1, "layers.3.attention.qkv.weight", (32, 16), split)
    assert schema.ParamEntry.from_json(json.loads(json.dumps(entry.to_json()))) == entry


def test_index_entry_equals_its_json_round_trip():
    params = [schema.ParamEntry(0, "embedding.word_embeddings.weight", (56, 16), TPSplit(0, None, 100)),
              schema.ParamEntry(0, "final_norm.weight", (16,), None)]
    regions = [{"params": [["final_norm.weight", 0, 16]], "padded": 16, "shard_lo": 0, "shard_len": 8}]
    entry = schema.index_entry(3, 1, 0, 1, params, regions)
    assert json.loads(json.dumps(entry)) == entry
    assert schema.entry_params(entry) == params
    index = schema.make_index([entry], {"output_layer.weight": "embedding.word_embeddings.weight"})
    meta = json.loads(json.dumps(schema.metadata(7, 56, schema.layout(1, 1, 1, None, 1, 0, torch.bfloat16),
                                                 {"seed": 1}, index, imported_from="x")))
    assert meta["index"]["version"] == schema.DENSE_VERSION == 3  # a dense model's index: still version 3
    assert meta["layout"]["params_dtype"] == "bfloat16" and meta["imported_from"] == "x"
    assert schema.read_index(meta, "m") == ([entry], {"output_layer.weight": "embedding.word_embeddings.weight"})


def test_read_index_versions():
    ranks = [{"rank": 0}]
    v1 = {"args": {}, "index": {"version": 1, "ranks": ranks}}
    assert schema.read_index(v1, "m") == (ranks, schema.FORMAT1_ALIASES)
    untied = dict(v1, args={"untie_embeddings_and_output_weights": True})
    assert schema.read_index(untied, "m") == (ranks, {})
    with pytest.raises(schema.CheckpointError, match="m: checkpoint format version 9"):
        schema.read_index({"index": {"version": 9, "ranks": ranks}}, "m")
    v2 = {"args": {}, "index": {"version": 2, "aliases": {}, "ranks": ranks}}
    assert schema.read_index(v2, "m") == (ranks, {})
    with pytest.raises(schema.CheckpointError, match="m has no index"):
        schema.read_index({"layout": {}}, "m")


def test_rank_state_keys_and_layout_diffs():
    full = schema.rank_state([{}], {"num_steps": 3}, {"skipped": 1, "nans": 0}, rng={"a": 1}, optimizer={"b": 2})
    assert list(full) == ["model", "rng", "scheduler", "counters", "optimizer"]
    assert list(schema.rank_state([{}], None, {"skipped": 0, "nans": 0})) == ["model", "scheduler", "counters"]
    a = schema.layout(4, 2, 1, None, 2, 1, "float32")
    assert schema.layout_diffs(a, dict(a, zero_stage=3)) == ["zero_stage saved 1 vs now 3"]
    assert tuple(a) == schema.LAYOUT_KEYS
    # a layout saved before EP/ETP were recorded reads as EP 1, ETP = TP
    old = {k: v for k, v in a.items() if not k.startswith("expert_")}
    assert schema.layout_diffs(old, a) == []
    assert schema.layout_diffs(old, schema.layout(4, 2, 1, None, 2, 1, "float32", ep=2, etp=1)) == [
        "expert_model_parallel_size saved 1 vs now 2", "expert_tensor_parallel_size saved 2 vs now 1"]


class _Tracker:
    def __init__(self):
        self.gen = torch.Generator().manual_seed(5)

    def state_dict(self):
        return {"state": self.gen.get_state()}

    def load_state_dict(self, sd):
        self.gen.set_state(sd["state"])


def _draws(trackers):
    return (random.random(), float(np.random.rand()), float(torch.rand(1)),
            [float(torch.rand(1, generator=t.gen)) for t in trackers])


def test_rng_round_trip():
    trackers = [_Tracker(), _Tracker()]
    state = rng_state(trackers)
    assert {"python", "python_pos", "numpy_keys", "numpy_pos", "torch", "trackers"} <= set(state)
    first = _draws(trackers)
    restore_rng(state, trackers)
    assert _draws(trackers) == first


def test_format3_entries_compare_with_older_versions():
    """A version-3 entry records where each weight is stored and which regions are partitioned;
    compared with a version-1/2 entry (the exact-resume check) those fields are left out, and a
    4-element (old) parameter entry reads as stored in the rank file's model."""
    params = [schema.ParamEntry(0, "layers.0.mlp.fc1.weight", (8, 4), None, schema.STORED_SHARD),
              schema.ParamEntry(0, "final_norm.weight", (4,), None, None)]
    regions = [{"params": [["layers.0.mlp.fc1.weight", 0, 32]], "padded": 32, "shard_lo": 16, "shard_len": 16,
                "partitioned": True}]
    entry = schema.index_entry(1, 0, 0, 1, params, regions)
    assert schema.entry_params(json.loads(json.dumps(entry))) == params
    old = schema.comparable_entry(entry, 2)
    assert [len(p) for p in old["params"]] == [4, 4] and "partitioned" not in old["regions"][0]
    assert schema.comparable_entry(entry, 3) == entry
    assert schema.ParamEntry.from_json(old["params"][0]).stored == schema.STORED_MODEL



def test_format4_expert_grid_and_buffers():
    """An entry with a routed expert's weight and a buffer is version 4: the rank's expert-grid
    coordinates, the expert marker after ``stored``, the buffers; all survive JSON. A version 1-3
    index of an MoE model is refused (its experts of EP ranks > 0 were never written)."""
    params = [schema.ParamEntry(0, "layers.0.mlp.router.weight", (4, 8), None),
              schema.ParamEntry(0, "layers.0.mlp.experts.2.fc1.weight", (6, 8), TPSplit(0, (6, 6)),
                                schema.STORED_MODEL, expert=True)]
    buffers = [schema.ParamEntry(0, "layers.0.mlp.router.expert_bias", (4,), None)]
    entry = schema.index_entry(3, 1, 0, 1, params, [], expert=(1, 0, 0), buffers=buffers)
    assert json.loads(json.dumps(entry)) == entry
    assert (entry["ep_rank"], entry["etp_rank"], entry["edp_rank"]) == (1, 0, 0)
    assert schema.entry_params(entry) == params and schema.entry_buffers(entry) == buffers
    assert schema.grid_ranks(entry, True) == (0, 0) and schema.grid_ranks(entry, False) == (1, 1)
    dense = schema.index_entry(0, 0, 0, 0, params[:1], [])
    assert schema.make_index([dense], {})["version"] == 3
    assert schema.make_index([dense, entry], {})["version"] == schema.VERSION == 4
    assert schema.make_index([schema.index_entry(0, 0, 0, 0, params[:1], [], buffers=buffers)], {})["version"] == 4
    meta = {"args": {"num_experts": 4}, "index": {"version": 3, "aliases": {}, "ranks": [dense]}}
    with pytest.raises(schema.CheckpointError, match="MoE checkpoint of format version 3"):
        schema.read_index(meta, "m")
    assert schema.read_index(dict(meta, index=schema.make_index([entry], {})), "m") == ([entry], {})
