//! Queue benchmarks (filled in with the bus issue).
fn main() {}
