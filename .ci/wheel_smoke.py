"""A built wheel's compiled parts load and agree with their Python twins (the release workflow runs this against
each cibuildwheel wheel, on its platform; nothing here is POSIX-only). Exits non-zero on any difference."""
from __future__ import annotations

import sys

import torch

import kvlab
import kvlab.fast.attention as attention
from kvlab.fast.compiled import compiled_report, install_check


def main() -> int:
    print(f"kvlab {kvlab.__version__} from {kvlab.__file__}; {compiled_report()}")
    if install_check():  # a part that applies here is not compiled: a platform wheel must carry it
        return 1
    if not kvlab.hotpath_compiled:
        print("FastBlockPool is not compiled", file=sys.stderr)
        return 1
    pools = [kvlab.BlockPool(64, with_storage=False), kvlab.FastBlockPool(64, with_storage=False)]
    runs = []
    for pool in pools:
        a = pool.allocate(5)
        b = pool.allocate(20)
        pool.free(a)
        c = pool.allocate(3)
        pool.free(b + c)
        pool.check_invariants()
        runs.append((a, b, c, pool.allocate(7)))
    if runs[0] != runs[1]:
        print(f"FastBlockPool differs from BlockPool: {runs}", file=sys.stderr)
        return 1
    if attention.DECODE_KERNEL_COMPILED:  # not on Windows (the kernel needs POSIX threads)
        g = torch.Generator().manual_seed(0)
        pool = kvlab.BlockPool(40, spec=kvlab.KVSpec(1, 2, 16, 8, torch.float32, torch.device("cpu")))
        assert pool.storage is not None
        tables, lens = [list(range(0, 10)), list(range(10, 25))], [77, 120]
        for table, n in zip(tables, lens):
            kv = torch.randn(2, n, 2, 16, generator=g)
            pool.storage.write_slots(0, [table[p // 8] * 8 + p % 8 for p in range(n)], kv[0], kv[1])
        q = torch.randn(2, 4, 16, generator=g)
        fast = attention.paged_attention(q, pool, 0, tables, lens, impl="compiled")
        torch.testing.assert_close(fast, attention.paged_attention(q, pool, 0, tables, lens, impl="torch"),
                                   atol=1e-5, rtol=1e-5)
    print("compiled parts agree with their Python twins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
