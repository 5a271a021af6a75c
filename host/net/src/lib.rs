//! Switchyard's outbound networking and the small pieces every floor that talks to the
//! outside shares: the HTTP connector and TLS configuration used for workers and etcd
//! alike ([`upstream`]), errors in words ([`error_chain`]), newline-delimited records
//! arriving in pieces ([`lines`]), one unit of a bounded count ([`slot`]), and operator
//! files read with a size bound ([`files`]).
//!
//! Knows no Switchyard concept above identifiers: no routing, no discovery, no policy.

pub mod files;
pub mod lines;
pub mod slot;
pub mod upstream;

/// An error and its causes in words, outermost first, each said once (`client error
/// (Connect): invalid peer certificate: UnknownIssuer`).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut last = out.clone();
    let mut source = e.source();
    while let Some(err) = source {
        let said = err.to_string();
        if !last.contains(&said) {
            out.push_str(": ");
            out.push_str(&said);
        }
        last = said;
        source = err.source();
    }
    out
}
