"""Which rank owns which point on which level (pure index maths; no MPI, no arrays).

Fine indices 0..N are block-distributed: block ``q`` (in solver order) holds fine indices
``starts[q] .. starts[q+1]-1`` (``starts[B] = N + 1``); block ``q`` lives on communicator rank
``ranks[q]``. The owner of fine index i owns point i on every level where i is a point, and owns
the step out of i (push propagators) or the step into i (pull propagators, see
:class:`mgnn.mgrit.MGRITSolver`).
"""
import bisect
import numbers
from dataclasses import dataclass


def block_starts(n_points, n_blocks, align=1):
    """First index of each of ``n_blocks`` contiguous blocks of range(n_points), as even as possible
    with every block starting on a multiple of ``align`` (uneven counts allowed).

    Raises ValueError if there are fewer multiples of ``align`` than blocks (some block would own
    no C-point).
    """
    if n_blocks < 1:
        raise ValueError(f"number of blocks must be >= 1, got {n_blocks}")
    n_units = (n_points - 1) // align + 1
    if n_units < n_blocks:
        raise ValueError(f"{n_points} points with C-points every {align} give {n_units} C-points, "
                         f"fewer than the {n_blocks} layer ranks: every rank must own a C-point")
    base, extra = divmod(n_units, n_blocks)
    starts, u = [], 0
    for q in range(n_blocks):
        starts.append(u * align)
        u += base + (1 if q < extra else 0)
    return starts


@dataclass(frozen=True)
class Partition:
    """Block distribution of fine indices 0..n_steps.

    Attributes
    ----------
    n_steps : int
        N (a NumPy integer is accepted).
    starts : tuple of int
        First fine index of each block, ascending, starts[0] == 0.
    ranks : tuple of int
        Communicator rank holding each block (same length as starts).
    """

    n_steps: int
    starts: tuple
    ranks: tuple

    def __post_init__(self):
        n = self.n_steps
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"Partition n_steps must be an int >= 1, got {n!r}")
        object.__setattr__(self, "n_steps", int(n))
        st, rk = tuple(self.starts), tuple(self.ranks)
        if len(st) != len(rk) or not st:
            raise ValueError(f"Partition needs one rank per block: starts {st}, ranks {rk}")
        if st[0] != 0 or any(b <= a for a, b in zip(st, st[1:])) or st[-1] > self.n_steps:
            raise ValueError(f"Partition starts {st} must begin at 0, increase strictly and stay "
                             f"<= n_steps={self.n_steps}")
        if len(set(rk)) != len(rk):
            raise ValueError(f"Partition ranks {rk} hold more than one block each")
        object.__setattr__(self, "starts", st)
        object.__setattr__(self, "ranks", rk)

    @classmethod
    def serial(cls, n_steps):
        """Everything on rank 0."""
        return cls(n_steps, (0,), (0,))

    def block_of_rank(self, rank):
        """Index of the block held by ``rank`` (ValueError if it holds none)."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} holds no block of this partition") from None

    def fine_range(self, rank):
        """Fine indices [lo, hi) held by ``rank``."""
        q = self.block_of_rank(rank)
        hi = self.starts[q + 1] if q + 1 < len(self.starts) else self.n_steps + 1
        return self.starts[q], hi

    def owner(self, fine_index):
        """Rank owning ``fine_index``."""
        return self.ranks[bisect.bisect_right(self.starts, fine_index) - 1]

    def level_range(self, rank, spacing, n_level):
        """Level points [a, b) held by ``rank`` on a level whose point j is fine index j*spacing
        (n_level intervals); may be empty (a == b)."""
        lo, hi = self.fine_range(rank)
        a = -(-lo // spacing)
        b = min(-(-hi // spacing), n_level + 1)
        return a, max(a, b)

    def mirrored(self):
        """The partition of reversed indices m = N - i with every point kept on its rank (for the
        adjoint solve): block order is reversed."""
        N = self.n_steps
        ends = list(self.starts[1:]) + [N + 1]
        starts = tuple(N - (e - 1) for e in reversed(ends))
        return Partition(N, starts, tuple(reversed(self.ranks)))
