//! Switchyard's lab: whole fleets in one process and the trace tooling that measures
//! routers on them.
//!
//! - [`local`]: mock workers and the router in one process, for the demo, replay and
//!   benchmarks.
//! - [`replay`]: Mooncake-format traces (read, generated, replayed through the real
//!   router policy by policy, or through another router), with the report.

pub mod local;
pub mod replay;
