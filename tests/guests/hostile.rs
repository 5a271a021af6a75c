// Shared by every hostile test policy (included with `include!`): the bindings, the
// `{"after": N}` switch that lets a policy pass its canary and misbehave later, and the
// exported type.

use switchyard::policy::types::RejectionKind;

wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

thread_local! {
    static AFTER: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// `{"after": N}`: behave for decisions with a sequence number below N.
#[allow(dead_code)]
fn configure_after(config: &str) -> Result<(), String> {
    let digits: String = config.chars().filter(|c| c.is_ascii_digit()).collect();
    AFTER.set(digits.parse().unwrap_or(0));
    Ok(())
}

/// True when this decision should misbehave.
#[allow(dead_code)]
fn misbehave(req: &Request) -> bool {
    req.sequence >= AFTER.get()
}

fn describe_self() -> Info {
    Info { name: env!("CARGO_PKG_NAME").to_string(), version: "0.1.0".to_string() }
}

#[allow(dead_code)]
fn reject(reason: &str) -> Rejection {
    Rejection { kind: RejectionKind::Refused, reason: reason.to_string() }
}

struct Hostile;

/// The `Guest` of a hostile guest that configures itself with `{"after": N}` and names
/// itself after its crate: only its `choose` is its own.
#[allow(unused_macros)]
macro_rules! hostile_choose {
    ($(#[$doc:meta])* fn choose($req:ident: Request, $candidates:ident: Candidates) -> Result<u64, Rejection> $body:block) => {
        #[allow(unused_variables)]
        impl Guest for Hostile {
            fn configure(config: String) -> Result<(), String> {
                configure_after(&config)
            }

            fn describe() -> Info {
                describe_self()
            }

            $(#[$doc])*
            fn choose($req: Request, $candidates: Candidates) -> Result<Placement, Rejection> {
                let worker = move || -> Result<u64, Rejection> { $body };
                worker().map(Placement::Worker)
            }
        }
    };
}

export!(Hostile);
