//! The core's integration tests, in one test binary (one link instead of one per file): property
//! tests against brute-force oracles, hostile inputs, end-to-end I/O and the storage layer.

mod assign_oracle;
mod backends;
mod checksum_oracle;
mod common;
mod compressed;
mod coop_oracle;
mod crash_states;
mod crash_states_object;
mod hostile_files;
mod index_oracle;
mod io_roundtrip;
mod manifest_hostile;
mod plan_oracle;
mod storage;
