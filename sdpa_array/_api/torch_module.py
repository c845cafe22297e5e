"""``sdpa_array.MultiheadAttention``: a drop-in for ``torch.nn.MultiheadAttention``.

The same constructor, parameter names (a ``state_dict`` loads both ways), ``forward``
arguments and outputs, computed by :func:`~sdpa_array.multi_head_attention`. Imported on
first use of ``sdpa_array.MultiheadAttention`` (torch is optional).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .multi_head import multi_head_attention

__all__ = ["MultiheadAttention"]


def _as_terms(mask: Any, name: str) -> tuple[Any, Any]:
    """torch's mask convention (boolean: ``True`` excludes; floating: added) as our
    ``(mask, bias)``: the boolean mask inverted, or the floating one as a bias."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return torch.logical_not(mask), None
    if not torch.is_floating_point(mask):
        raise TypeError(f"{name} must be a boolean or floating tensor, got {mask.dtype}")
    return None, mask


def _pad_keys(term: Any, extra: int, fill: Any) -> Any:
    """``term`` with ``extra`` key columns of ``fill`` appended (``bias_k``, zero attention)."""
    if term is None or not extra:
        return term
    pad = torch.full((*term.shape[:-1], extra), fill, dtype=term.dtype, device=term.device)
    return torch.cat([term, pad], dim=-1)


def _combine(a: Any, b: Any, op: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    return op(a, b)


class MultiheadAttention(nn.Module):
    """Multi-head attention, a drop-in for :class:`torch.nn.MultiheadAttention`.

    Parameters
    ----------
    embed_dim : int
        ``E``, the queries' width and the output's.
    num_heads : int
        Heads; ``E`` must be divisible by them.
    dropout : float, default 0.0
        Attention dropout in training.
    bias : bool, default True
        Biases on the input and output projections.
    add_bias_kv : bool, default False
        Learned key and value rows appended to every sequence.
    add_zero_attn : bool, default False
        A key and value of zeros appended to every head.
    kdim, vdim : int, optional
        The keys' and values' widths (``E`` by default).
    batch_first : bool, default False
        Inputs and outputs as ``(N, L, E)`` rather than ``(L, N, E)``.
    device, dtype : optional
        Where and in what dtype the parameters are made.

    Notes
    -----
    The parameters and their initialisation are torch's: ``in_proj_weight`` ``(3 E, E)``
    (or ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` when ``kdim``/``vdim``
    differ from ``E``), ``in_proj_bias``, ``out_proj`` (a ``Linear``), ``bias_k`` and
    ``bias_v``.

    ``forward`` takes torch's arguments: ``key_padding_mask`` and ``attn_mask``, boolean
    (``True`` excludes) or floating (added to the scores), ``attn_mask`` of shape ``(L, S)``
    or ``(N * num_heads, L, S)``; ``need_weights`` and ``average_attn_weights``; and
    ``is_causal``, torch's hint that ``attn_mask`` is the causal mask, which must then be
    given; the call then runs with ``is_causal=True`` and the mask's contents are not read,
    as torch's fused path does. Dropout (in training, ``dropout > 0``) draws each call's seed
    from torch's default generator and uses the library's dropout, whose bits depend only on
    that seed. A row whose every key is excluded gives zeros where torch gives NaN.

    Examples
    --------
    >>> import torch
    >>> from sdpa_array import MultiheadAttention
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> ours = MultiheadAttention(8, 2, batch_first=True)
    >>> theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    >>> _ = theirs.load_state_dict(ours.state_dict())
    >>> x = torch.randn(3, 5, 8)
    >>> out, weights = ours(x, x, x)
    >>> expected, expected_weights = theirs(x, x, x)
    >>> bool(torch.allclose(out, expected, atol=1e-6)), tuple(weights.shape)
    (True, (3, 5, 5))
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be positive, got {embed_dim} and {num_heads}"
            )
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory))
        else:
            self.register_parameter("bias_k", None)
            self.register_parameter("bias_v", None)
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform projections, zero biases, Xavier-normal
        ``bias_k``/``bias_v``."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def _params(self) -> dict[str, Any]:
        E = self.embed_dim
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            weights = (w[:E], w[E : 2 * E], w[2 * E :])
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        params = dict(zip(("q_weight", "k_weight", "v_weight"), weights, strict=True))
        params["out_weight"] = self.out_proj.weight
        if self.in_proj_bias is not None:
            b = self.in_proj_bias
            params.update(q_bias=b[:E], k_bias=b[E : 2 * E], v_bias=b[2 * E :])
        if self.out_proj.bias is not None:
            params["out_bias"] = self.out_proj.bias
        if self.bias_k is not None:
            params.update(bias_k=self.bias_k[0], bias_v=self.bias_v[0])
        return params

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention output and (with ``need_weights``) the weights, as torch's module
        returns them (see the class Notes for the masks and ``is_causal``).

        Parameters
        ----------
        query : torch.Tensor
            ``(L, N, E)``, ``(N, L, E)`` with ``batch_first``, or ``(L, E)`` unbatched.
        key, value : torch.Tensor
            ``(S, N, kdim)`` and ``(S, N, vdim)`` (batch first or unbatched alike).
        key_padding_mask : torch.Tensor, optional
            ``(N, S)`` (``(S,)`` unbatched): boolean, ``True`` for a key to ignore, or
            floating, added to the scores.
        need_weights : bool, default True
            Also return the attention weights.
        attn_mask : torch.Tensor, optional
            ``(L, S)`` or ``(N * num_heads, L, S)``: boolean, ``True`` for a pair that may
            not attend, or floating, added to the scores.
        average_attn_weights : bool, default True
            Average the weights over the heads.
        is_causal : bool, default False
            torch's hint that ``attn_mask`` is the causal mask (which must be given).

        Returns
        -------
        attn_output : torch.Tensor
            The queries' shape with ``E`` features.
        attn_weights : torch.Tensor or None
            ``(N, L, S)`` (averaged) or ``(N, num_heads, L, S)``, after dropout; ``None``
            without ``need_weights``.
        """
        batched = query.dim() == 3
        if is_causal and attn_mask is None:
            raise ValueError(
                "is_causal is a hint that attn_mask is the causal mask: pass attn_mask too "
                "(as torch.nn.MultiheadAttention requires)"
            )
        query, key, value = self._batch_first(query, key, value)
        sizes = (query.shape[0], query.shape[1], key.shape[1])
        given = attn_mask if not is_causal else None
        mask, bias = self._masks(key_padding_mask, given, sizes, batched)
        extra = int(self.bias_k is not None) + int(self.add_zero_attn)
        options: dict[str, Any] = {
            "mask": _pad_keys(mask, extra, True),
            "bias": _pad_keys(bias, extra, 0.0),
            "is_causal": is_causal,
            "return_weights": need_weights,
        }
        if self.training and self.dropout > 0:
            seed = int(torch.randint(0, 2**62, (1,)).item())
            options.update(dropout_p=self.dropout, dropout_seed=seed)
        result = multi_head_attention(
            query, key, value, self._params(), num_heads=self.num_heads,
            add_zero_attn=self.add_zero_attn, **options,
        )  # fmt: skip
        out, weights = result if need_weights else (result, None)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _batch_first(self, *arrays: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The query, key and value checked to be all 3-D or all 2-D, batch first (an
        unbatched call given a batch of one)."""
        if arrays[0].dim() not in (2, 3) or any(t.dim() != arrays[0].dim() for t in arrays):
            raise ValueError(
                "query, key and value must be all 3-D (batched) or all 2-D (unbatched), got "
                f"shapes {', '.join(str(tuple(t.shape)) for t in arrays)}"
            )
        if arrays[0].dim() == 2:
            return tuple(t.unsqueeze(0) for t in arrays)
        if not self.batch_first:
            return tuple(t.transpose(0, 1) for t in arrays)
        return arrays

    def _masks(
        self,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        sizes: tuple[int, int, int],
        batched: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The boolean mask and the additive bias of torch's two masks (checked against
        the batch-first ``(N, L, S)`` of the call), broadcastable to ``(N, H, L, S)``."""
        N, L, S = sizes
        mask, bias = None, None
        if key_padding_mask is not None:
            kpm = key_padding_mask if batched else key_padding_mask.unsqueeze(0)
            if tuple(kpm.shape) != (N, S):
                raise ValueError(
                    f"key_padding_mask must be (batch, source length) = {(N, S)}, got "
                    f"{tuple(key_padding_mask.shape)}"
                )
            mask, bias = _as_terms(kpm[:, None, None, :], "key_padding_mask")
        if attn_mask is not None:
            am, heads = attn_mask, self.num_heads
            if am.dim() == 3:
                expected = (N * heads, L, S) if batched else (heads, L, S)
                if tuple(am.shape) != expected:
                    raise ValueError(f"a 3-D attn_mask must be {expected}, got {tuple(am.shape)}")
                am = am.reshape(N, heads, L, S)
            elif am.dim() != 2 or tuple(am.shape) != (L, S):
                raise ValueError(f"attn_mask must be (L, S) = {(L, S)} or 3-D, got {am.shape}")
            m, b = _as_terms(am, "attn_mask")
            mask = _combine(mask, m, torch.logical_and)
            bias = _combine(bias, b, torch.add)
        return mask, bias
