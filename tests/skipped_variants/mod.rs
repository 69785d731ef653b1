//! Test variants that depend on the machine (the io_uring path, the AVX2 versions of the epoch
//! log's encoders) are skipped where the machine lacks what they need. A skip is a passing
//! test that tested nothing, so CI, which knows what its machine has, can forbid it: with
//! `COORDBUS_REQUIRE_IO_URING=1` or `COORDBUS_REQUIRE_AVX2=1` in the environment, a variant
//! that would be skipped fails instead.

#![allow(dead_code)]

/// Reports that an io_uring variant is skipped because of `reason` (the kernel refuses
/// io_uring), or fails the test if `COORDBUS_REQUIRE_IO_URING=1`.
pub fn skip_io_uring_variant(reason: &dyn std::fmt::Display) {
    skip("COORDBUS_REQUIRE_IO_URING", "io_uring", reason);
}

/// Reports that an AVX2 variant is skipped (the CPU has no AVX2), or fails the test if
/// `COORDBUS_REQUIRE_AVX2=1`.
pub fn skip_avx2_variant() {
    skip("COORDBUS_REQUIRE_AVX2", "AVX2", &"the CPU has no AVX2");
}

fn skip(variable: &str, what: &str, reason: &dyn std::fmt::Display) {
    assert!(
        std::env::var_os(variable).is_none_or(|value| value != "1"),
        "{variable}=1, but the {what} variant would be skipped: {reason}"
    );
    eprintln!("skipping the {what} variant: {reason}");
}
