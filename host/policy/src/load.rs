//! The engine's `load` methods: a policy's bytes (a built-in, a file, an upload) to a
//! [`LoadedPolicy`]. They sit apart from both: the engine compiles and links, knowing
//! nothing of `LoadedPolicy`; the loaded policy knows nothing of files and built-ins.

use std::path::Path;
use std::time::Instant;

use super::engine::PolicyEngine;
use super::loaded::{LoadedPolicy, PolicySource};
use super::{PolicyError, builtin};

impl PolicyEngine {
    /// Loads a policy: a built-in name (`kv-cost`, `round-robin`) or a path to a `.wasm`.
    pub fn load_spec(&self, spec: &str, config_json: &str) -> Result<LoadedPolicy, PolicyError> {
        match builtin(spec) {
            Some(b) => self.load(PolicySource::Builtin(b.name), b.wasm, config_json),
            None if spec.ends_with(".wasm") || Path::new(spec).exists() => {
                self.load_file(Path::new(spec), config_json)
            }
            None => Err(PolicyError::UnknownBuiltin(spec.to_string())),
        }
    }

    /// Loads a policy from a `.wasm` file.
    pub fn load_file(&self, path: &Path, config_json: &str) -> Result<LoadedPolicy, PolicyError> {
        use std::io::Read;
        let io = |source| PolicyError::Io {
            path: path.to_path_buf(),
            source,
        };
        // Read at most one byte past the limit: a huge file is refused, not read whole.
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .map_err(io)?
            .take(super::MAX_POLICY_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(io)?;
        self.load(PolicySource::File(path.to_path_buf()), &bytes, config_json)
    }

    /// Compiles (or fetches from cache), links, instantiates and configures a policy.
    /// The returned policy has one warm, configured instance; it has not been
    /// canary-tested yet (see [`LoadedPolicy::canary`]).
    pub fn load(
        &self,
        source: PolicySource,
        bytes: &[u8],
        config_json: &str,
    ) -> Result<LoadedPolicy, PolicyError> {
        let started = Instant::now();
        let (pre, sha256, cache) = self.link(bytes)?;
        LoadedPolicy::new(
            self.clone(),
            pre,
            source,
            sha256,
            config_json,
            cache,
            started,
        )
    }
}
