"""A request's drafts over its life (requests.draft_tokens, accepted_tokens) are the reader's sums of the
capture's spec_decode rows (importer.DraftTotals): the capture leaves them out of the request's row so
that a step costs no pass over its requests' states."""
from __future__ import annotations

from kvtrace.vllm.importer import DraftTotals


def spec_rows(*rows):
    return {"req_id": [r[0] for r in rows], "draft_tokens": [r[1] for r in rows],
            "accepted_tokens": [r[2] for r in rows]}


def request_rows(*rids, drafts=None):
    n = len(rids)
    return {"req_id": list(rids), "draft_tokens": [drafts] * n, "accepted_tokens": [drafts] * n}


def test_totals_are_summed_over_chunks_into_the_row_of_a_request_that_finishes():
    totals = DraftTotals()
    first = {"spec_decode": spec_rows(("a", 3, 2), ("b", 3, 0), ("a", 3, 3)), "requests": request_rows()}
    # a step whose output was never processed counts no draft
    second = {"spec_decode": spec_rows(("a", 2, 1), ("b", 3, None)), "requests": request_rows("a")}
    third = {"spec_decode": spec_rows(("b", 1, 1)), "requests": request_rows("b", "c")}
    for chunk in (first, second, third):
        totals.add(chunk)
    assert second["requests"]["draft_tokens"] == [8] and second["requests"]["accepted_tokens"] == [6]
    # b's drafts of the first and third chunks; c never drafted
    assert third["requests"]["draft_tokens"] == [4, 0] and third["requests"]["accepted_tokens"] == [1, 0]
    assert not totals.drafts and not totals.accepted   # nothing kept of a finished request


def test_an_older_captures_rows_keep_what_they_have():
    totals = DraftTotals()
    with_totals = {"spec_decode": spec_rows(("a", 3, 2)), "requests": request_rows("a", drafts=7)}
    totals.add(with_totals)
    assert with_totals["requests"]["draft_tokens"] == [7]
    without = {"requests": {"req_id": ["b"], "output_tokens": [4]}}   # before drafts were captured
    totals.add(without)
    assert without["requests"] == {"req_id": ["b"], "output_tokens": [4]}
