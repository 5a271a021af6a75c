//! Switchyard's outbound connections: the HTTP connector and TLS configuration used for
//! workers and etcd alike ([`upstream`]), and their errors in words ([`error_chain`]).
//!
//! Knows no Switchyard concept: no routing, no discovery, no policy.

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
