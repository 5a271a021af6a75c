//! Input from outside, held to bounds — the pieces every floor that reads the outside
//! shares, in plain `std`: one budget of bytes for everything read at once ([`budget`]);
//! files the operator names, read with a size bound ([`files`]);
//! newline-delimited records arriving in pieces ([`lines`]); one unit of a bounded
//! count, given back when dropped ([`slot`]).
//!
//! Knows nothing of Switchyard, of HTTP or of a runtime: the floor every crate may use.

pub mod budget;
pub mod files;
pub mod lines;
pub mod slot;
