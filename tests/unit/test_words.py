from sluice.core.words import counted


def test_a_count_reads_as_english() -> None:
    assert counted(1, "call") == "1 call"
    assert counted(0, "call") == "0 calls"
    assert counted(1024, "tenant") == "1,024 tenants"
