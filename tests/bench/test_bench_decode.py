

def test_a_peer_killed_by_a_signal_on_an_amx_cpu_gets_a_build_to_try():
    """llama-cpp-python built native crashed in its AMX product on an AMX Xeon: the skipped rows' note says what
    build ran there; an exit code, or a CPU without AMX, gets no such note."""
    from nanoserve.bench.decode import LLAMA_CPP_WITHOUT_AMX, crash_hint

    hint = crash_hint(-11, {"avx512f", "amx_int8", "amx_tile"})
    assert "signal 11" in hint and LLAMA_CPP_WITHOUT_AMX in hint and "-DGGML_NATIVE=OFF" in hint
    assert crash_hint(1, {"amx_int8"}) == "" and crash_hint(-11, {"avx512f", "avx512_vnni"}) == ""
