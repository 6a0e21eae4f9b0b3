//! Criterion benchmarks of powerinfer-rs live in `benches/benches/`; this library is empty and
//! exists only because Cargo needs a target for the package.
