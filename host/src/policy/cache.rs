//! On-disk cache of compiled policies.
//!
//! `Component::new` costs tens of milliseconds; loading precompiled code costs a fraction
//! of one. Entries are keyed by the policy's sha256 *and* the engine's compatibility hash
//! (wasmtime version, target, settings), so an upgraded host never loads stale code.
//! Each entry carries the sha256 of its own bytes, checked before it is loaded: a
//! truncated or altered file is recompiled, never executed.

use std::hash::{Hash, Hasher};
use std::path::Path;

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Where a compiled policy came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Compiled now (no cache, or a miss).
    Compiled,
    /// Loaded from the on-disk cache.
    Disk,
    /// Already compiled in this process.
    Memory,
}

/// Lower-case hex sha256.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut s = String::with_capacity(64);
    for b in digest {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

fn engine_key(engine: &Engine) -> String {
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    engine.precompile_compatibility_hash().hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Compiles `bytes`, through the cache in `dir` when there is one. Cache I/O errors are
/// logged and only cost a compile.
pub(crate) fn compile(
    engine: &Engine,
    bytes: &[u8],
    sha256: &str,
    dir: Option<&Path>,
) -> wasmtime::Result<(Component, CacheOutcome)> {
    let Some(dir) = dir else {
        return Ok((Component::new(engine, bytes)?, CacheOutcome::Compiled));
    };
    let path = dir.join(format!("{sha256}-{}.cwasm", engine_key(engine)));
    if let Ok(artifact) = std::fs::read(&path)
        && let Some(component) = deserialize_checked(engine, &artifact)
    {
        return Ok((component, CacheOutcome::Disk));
    }
    // Compiled once: the artifact is both stored and loaded.
    let artifact = engine.precompile_component(bytes)?;
    // SAFETY: `artifact` was produced just above by `precompile_component` of this same
    // engine, which is exactly what `Component::deserialize` requires.
    #[allow(unsafe_code)]
    let component = unsafe { Component::deserialize(engine, &artifact) }?;
    if let Err(e) = store(dir, &path, &artifact) {
        tracing::warn!(path = %path.display(), error = %e, "cannot write the policy cache");
    }
    Ok((component, CacheOutcome::Compiled))
}

/// Layout of a cache file: 64 hex chars of the artifact's sha256, then the artifact.
fn store(dir: &Path, path: &Path, artifact: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut data = sha256_hex(artifact).into_bytes();
    data.extend_from_slice(artifact);
    // Write then rename, so a concurrent reader never sees half a file.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &data)?;
    std::fs::rename(&tmp, path)
}

fn deserialize_checked(engine: &Engine, data: &[u8]) -> Option<Component> {
    if data.len() < 64 {
        return None;
    }
    let (sum, artifact) = data.split_at(64);
    if sum != sha256_hex(artifact).as_bytes() {
        tracing::warn!("a policy cache entry does not match its checksum; recompiling");
        return None;
    }
    // SAFETY: `Component::deserialize` requires bytes produced by
    // `Engine::precompile_component` of a compatible engine. This file was written by
    // `store` above from exactly such bytes (the name carries the engine's
    // compatibility hash) and its checksum matches, so it is the artifact we wrote.
    #[allow(unsafe_code)]
    let component = unsafe { Component::deserialize(engine, artifact) };
    component.ok()
}
