"""GRU/RNN gate epilogues."""

from ..numpy_ref import gate_check


class RecurrentKernels:
    """The recurrent gate kernels of :class:`mgnn.backend.cupy_raw.RawBackend` (a mixin)."""

    # Contracts of mgnn.backend.numpy_ref (RECURRENT_KERNELS); one elementwise launch of
    # kernels/recurrent.cu each, over the B*H elements of h.
    def gru_gates_forward(self, gi, gh, h, dt, mode):
        """(h_next (B, H), cache (B, 4, H)); contract of
        :func:`mgnn.backend.numpy_ref.gru_gates_forward`."""
        B, H, dt, mode = gate_check(h, dt, mode, gi=(gi, 3), gh=(gh, 3))
        outs = self._empty((B, H), h.dtype), self._empty((B, 4, H), h.dtype)
        self._elementwise("gru_gates_forward", B * H, h.dtype, gi, gh, h, *outs, B * H, H, dt,
                          mode)
        return outs

    def gru_gates_vjp(self, g, h, cache, dt, mode):
        """(dh_direct (B, H), dgi (B, 3H), dgh (B, 3H)); contract of
        :func:`mgnn.backend.numpy_ref.gru_gates_vjp`."""
        B, H, dt, mode = gate_check(h, dt, mode, g=(g, 1), cache=(cache, (4,)))
        outs = (self._empty((B, H), h.dtype), self._empty((B, 3 * H), h.dtype),
                self._empty((B, 3 * H), h.dtype))
        self._elementwise("gru_gates_vjp", B * H, h.dtype, g, h, cache, *outs, B * H, H, dt,
                          mode)
        return outs

    def rnn_gates_forward(self, gi, gh, h, dt):
        """(h_next, deriv), both (B, H); contract of
        :func:`mgnn.backend.numpy_ref.rnn_gates_forward`."""
        B, H, dt, _ = gate_check(h, dt, 0, gi=(gi, 1), gh=(gh, 1))
        outs = self._empty((B, H), h.dtype), self._empty((B, H), h.dtype)
        self._elementwise("rnn_gates_forward", B * H, h.dtype, gi, gh, h, *outs, B * H, dt)
        return outs

    def rnn_gates_vjp(self, g, h, deriv, dt):
        """(dh_direct, da), both (B, H); contract of
        :func:`mgnn.backend.numpy_ref.rnn_gates_vjp`."""
        B, H, dt, _ = gate_check(h, dt, 0, g=(g, 1), deriv=(deriv, 1))
        outs = self._empty((B, H), h.dtype), self._empty((B, H), h.dtype)
        self._elementwise("rnn_gates_vjp", B * H, h.dtype, g, deriv, *outs, B * H, dt)
        return outs
