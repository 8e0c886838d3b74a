"""KVStorage refuses bad input with a typed error naming the value, and a refused call leaves the KV tensor
bitwise unchanged: no float slot truncated, no negative layer wrapping to the last one, no out-of-range id
reaching an index kernel."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvlab import ConfigError, KVDataError, KVSpec, KVStorage, UnknownBlockError

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, device="cpu")
KV1 = torch.ones(1, 2, 4)  # one token's K (or V)
BLOCK = torch.zeros(2, 2, 1, 4, 2, 4)  # one block, as gather_blocks returns it


@pytest.fixture
def st() -> KVStorage:
    s = KVStorage(SPEC, 8)
    s.kv.copy_(torch.randn(s.kv.shape, generator=torch.Generator().manual_seed(0)))
    return s


@pytest.mark.parametrize("num_blocks", [None, 1.0, "1", [1], True, np.bool_(True)], ids=repr)
def test_num_blocks_must_be_a_positive_int(num_blocks):
    with pytest.raises(ConfigError, match=re.escape(repr(num_blocks))):
        KVStorage(SPEC, num_blocks)


def test_spec_must_be_a_kvspec():
    with pytest.raises(ConfigError, match="'spec'"):
        KVStorage("spec", 4)  # type: ignore[arg-type]


TWO = torch.ones(2, 2, 4)
BAD_CALLS = {  # (the call, its error, what the message names)
    "block_view(-1)": (lambda s: s.block_view(-1), UnknownBlockError, "-1"),
    "block_view(99)": (lambda s: s.block_view(99), UnknownBlockError, "99"),
    "block_view(7, 2)": (lambda s: s.block_view(7, 2), UnknownBlockError, "block 7"),
    "block_view(0.5)": (lambda s: s.block_view(0.5), UnknownBlockError, "0.5"),
    "block_view(True)": (lambda s: s.block_view(True), UnknownBlockError, "True"),
    "read slot 32": (lambda s: s.read_slots(0, [32]), UnknownBlockError, "32"),
    "read slot -1": (lambda s: s.read_slots(0, [-1]), UnknownBlockError, "-1"),
    "read layer 2": (lambda s: s.read_slots(2, [0]), ConfigError, "layer 2"),
    "read layer True": (lambda s: s.read_slots(True, [0]), ConfigError, "layer True"),
    "read float slot tensor": (lambda s: s.read_slots(0, torch.tensor([0.5])), UnknownBlockError, "0.5"),
    "write layer -1": (lambda s: s.write_slots(-1, [0], KV1, KV1), ConfigError, "layer -1"),
    "write layer 1.0": (lambda s: s.write_slots(1.0, [0], KV1, KV1), ConfigError, "layer 1.0"),
    "write slot 0.5": (lambda s: s.write_slots(0, [0.5], KV1, KV1), UnknownBlockError, "0.5"),
    "write slot True": (lambda s: s.write_slots(0, [True], KV1, KV1), UnknownBlockError, "True"),
    "write slot 32": (lambda s: s.write_slots(0, [32], KV1, KV1), UnknownBlockError, "32"),
    "write slot tensor 99": (lambda s: s.write_slots(0, torch.tensor([0, 99]), TWO, TWO), UnknownBlockError, "99"),
    "write slot 2**63": (lambda s: s.write_slots(0, [0, 2**63], TWO, TWO), UnknownBlockError, str(2**63)),
    "copy to 8": (lambda s: s.copy_blocks([0], [8]), UnknownBlockError, "8"),
    "copy from -1": (lambda s: s.copy_blocks([-1], [0]), UnknownBlockError, "-1"),
    "copy from 0.5": (lambda s: s.copy_blocks([0.5], [1]), UnknownBlockError, "0.5"),
    "gather 8": (lambda s: s.gather_blocks([8]), UnknownBlockError, "8"),
    "gather into a wrong out": (lambda s: s.gather_blocks([0], out=torch.zeros(3)), KVDataError, r"\[3\]"),
    "scatter 8": (lambda s: s.scatter_blocks([8], BLOCK), UnknownBlockError, "8"),
    "scatter float id array": (lambda s: s.scatter_blocks(np.array([0.0]), BLOCK), UnknownBlockError, r"0\."),
    "scatter None": (lambda s: s.scatter_blocks([0], None), KVDataError, "None"),
    "scatter float64": (lambda s: s.scatter_blocks([0], BLOCK.double()), KVDataError, "float64"),
}


@pytest.mark.parametrize("call, error, named", BAD_CALLS.values(), ids=BAD_CALLS)
def test_bad_ids_and_layers_are_refused_and_change_nothing(st, call, error, named):
    before = st.kv.clone()
    with pytest.raises(error, match=named):
        call(st)
    assert torch.equal(st.kv, before)


def test_numpy_ints_and_int_tensors_are_still_ids(st):
    k = torch.randn(2, 2, 4)
    st.write_slots(np.int64(1), np.array([5, 9]), k, -k)
    st.copy_blocks(torch.tensor([1, 2], dtype=torch.int32), (np.int64(6), 7))
    got_k, got_v = st.read_slots(1, range(25, 30, 4))  # slots 5 and 9, copied to blocks 6 and 7
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    assert torch.equal(st.block_view(np.int64(6), np.int64(2)), st.gather_blocks([6, 7]).flatten(2, 3))
