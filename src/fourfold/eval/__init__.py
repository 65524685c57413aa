"""Evaluation of trained models: the memorization audit."""

from fourfold.eval.memorization import (
    DocumentResult,
    MemorizationAuditError,
    MemorizationReport,
    audit_memorization,
    greedy_decode,
    greedy_next,
    lcs_length,
    rouge_l_f1,
)

__all__ = ["DocumentResult", "MemorizationAuditError", "MemorizationReport",
           "audit_memorization", "greedy_decode", "greedy_next", "lcs_length", "rouge_l_f1"]
