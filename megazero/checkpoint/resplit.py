"""Reading a range of a parameter saved with another TP size, touching only the saved rows it
needs (a mixin of :class:`~megazero.checkpoint.reader.CheckpointReader`).

A loading rank of TP size ``tp`` asks for elements ``[a, b)`` of its flattened slice. Along the
split dimension every position of that slice is followed through the split rule itself
(:meth:`TPSplit.to_local` of ``1 + arange(full length)`` for the saved and the new size), which
gives the saved TP rank and row holding it (padding rows: none); split along dim 0 the runs of
consecutive saved rows are read, along dim 1 of a matrix the rows of each saved piece holding
some of the slice's columns. A rank reads at most about twice its share, never a whole
parameter. The saved size is that of the parameter's grid (a routed expert's: expert TP).
"""

from __future__ import annotations

import torch


class ResplitReads:
    """Uses the reader's ``_size`` (saved pieces per name), ``_flat_range`` and ``layout``."""

    def _owners(self, split, entry, tp_rank: int, tp: int, local_len: int):
        """Along the split dim: for each position of the loading rank's slice, the saved TP rank
        and position holding it, ``(-1, -1)`` for padding rows. Positions are followed through
        the split rule itself (:meth:`TPSplit.to_local` of ``1 + arange(full length)``), so
        partition blocks and padded vocabularies map as the model maps them."""
        saved = self._size[entry.name]
        d, full_len = split.dim, split.real_rows or entry.shape[split.dim] * saved
        ids = (torch.arange(full_len) + 1).reshape((-1, 1) if d == 0 else (1, -1))

        def positions(rank, size, rows):
            return split.to_local(ids, rank, size, local_rows=rows if d == 0 else None).reshape(-1) - 1
        owner_rank, owner_pos = torch.full((full_len,), -1), torch.full((full_len,), -1)
        for t in range(saved):
            old = positions(t, saved, entry.shape[0])
            real = old >= 0
            owner_rank[old[real]], owner_pos[old[real]] = t, torch.arange(len(old))[real]
        new = positions(tp_rank, tp, local_len)
        real = new >= 0
        ranks, pos = torch.full_like(new, -1), torch.full_like(new, -1)
        ranks[real], pos[real] = owner_rank[new[real]], owner_pos[new[real]]
        return ranks.tolist(), pos.tolist()

    def _resplit_range(self, name: str, kind: str, entry, tp_rank: int, tp: int, shape: tuple, a: int,
                       b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of the flattened slice (``shape``) of TP rank ``tp_rank`` of ``tp``
        of a parameter saved with another TP size, reading only the saved rows it needs: split
        along dim 0, the saved pieces' runs of consecutive rows that hold rows ``[a // c, ceil(b /
        c))`` (c = elements per row); along dim 1 of a matrix, those rows of each saved piece
        holding some of this slice's columns. Per rank the bytes read are about its share."""
        split, numel = entry.split, entry.numel()
        ranks, pos = self._owners(split, entry, tp_rank, tp, shape[split.dim])
        cols = numel // entry.shape[0]  # saved elements per row
        width = 1
        for s in shape[1:]:
            width *= s
        r0, r1 = a // width, -(-b // width)
        dtype = getattr(torch, self.layout.get("params_dtype") or "float32") if kind == "weight" else torch.float32
        if split.dim == 0:
            out, i = [], r0
            while i < r1:  # one read per run of consecutive saved rows of one saved rank
                j = i + 1
                while j < r1 and ranks[j] == ranks[i] and (ranks[i] < 0 or pos[j] == pos[j - 1] + 1):
                    j += 1
                out.append(torch.zeros((j - i) * width, dtype=dtype) if ranks[i] < 0 else
                           self._flat_range(name, kind, ranks[i], numel, pos[i] * cols, (pos[i] + j - i) * cols))
                i = j
            flat = torch.cat(out) if out else torch.zeros(0, dtype=dtype)
        else:
            block = torch.zeros((r1 - r0, shape[1]), dtype=dtype)
            for t in sorted(set(ranks) - {-1}):
                mine = [j for j, r in enumerate(ranks) if r == t]
                rows = self._flat_range(name, kind, t, numel, r0 * cols, r1 * cols).view(r1 - r0, cols)
                block[:, mine] = rows[:, [pos[j] for j in mine]].to(dtype)
            flat = block.reshape(-1)
        return flat[a - r0 * width:b - r0 * width]
