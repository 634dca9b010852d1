"""Quantizers. :mod:`coldkv.quantizers.a2ats` is the A2ATS seed API."""

import coldkv  # noqa: F401  (preloads OpenBLAS before mlx)
from coldkv.quantizers.a2ats import (
    a2ats_cholesky_factor,
    a2ats_h_weighted_assignment,
    a2ats_query_aware_assignment,
    a2ats_query_second_moment,
    a2ats_select_retrieval_set,
)

__all__ = [
    "a2ats_query_second_moment",
    "a2ats_cholesky_factor",
    "a2ats_h_weighted_assignment",
    "a2ats_query_aware_assignment",
    "a2ats_select_retrieval_set",
]
