//! On-disk cache of compiled policies.
//!
//! `Component::new` costs tens of milliseconds; loading precompiled code costs a fraction
//! of one. Entries are keyed by the policy's sha256 *and* the engine's compatibility hash
//! (wasmtime version, target, settings), so an upgraded host never loads stale code.
//!
//! Loading compiled code runs it outside the sandbox, so an entry is trusted only if
//! this router wrote it: each carries an HMAC-SHA256 of its bytes under a key kept in
//! the cache directory (`key`, 32 random bytes, created mode 0600 on first use). An
//! entry whose tag does not verify (truncated, altered, or written by someone without
//! the key) is recompiled, never executed. A key file that others may read or write is
//! not trusted: the cache is then not used at all, and the router says why.

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
    let key = dir.and_then(|dir| match cache_key(dir) {
        Ok(key) => Some(key),
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "the policy cache is not used");
            None
        }
    });
    let (Some(dir), Some(key)) = (dir, key) else {
        return Ok((Component::new(engine, bytes)?, CacheOutcome::Compiled));
    };
    let path = dir.join(format!("{sha256}-{}.cwasm", engine_key(engine)));
    if let Ok(entry) = std::fs::read(&path)
        && let Some(component) = deserialize_checked(engine, &key, &entry)
    {
        return Ok((component, CacheOutcome::Disk));
    }
    // Compiled once: the artifact is both stored and loaded.
    let artifact = engine.precompile_component(bytes)?;
    // SAFETY: `artifact` was produced just above by `precompile_component` of this same
    // engine, which is exactly what `Component::deserialize` requires.
    #[allow(unsafe_code)]
    let component = unsafe { Component::deserialize(engine, &artifact) }?;
    if let Err(e) = store(&key, &path, &artifact) {
        tracing::warn!(path = %path.display(), error = %e, "cannot write the policy cache");
    }
    Ok((component, CacheOutcome::Compiled))
}

/// Length of an entry's tag (HMAC-SHA256).
const TAG_LEN: usize = 32;

/// The cache's HMAC key: read from `dir/key`, or created there (0600, exclusively) on
/// first use. Refused if it is not 32 bytes, or not this user's alone.
fn cache_key(dir: &Path) -> std::io::Result<ring::hmac::Key> {
    use std::io::{Error, ErrorKind, Write};
    #[cfg(unix)]
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    let path = dir.join("key");
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    builder.mode(0o700);
    builder.create(dir)?;
    if !path.exists() {
        let mut fresh = [0u8; TAG_LEN];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut fresh)
            .map_err(|_| Error::other("no system randomness for the cache key"))?;
        // Written whole under another name, then linked into place: a router starting
        // at the same moment sees no key or the whole key, and one key wins.
        let tmp = dir.join(format!("key.tmp{}", std::process::id()));
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        options.mode(0o600);
        let mut file = options.open(&tmp)?;
        file.write_all(&fresh)?;
        file.sync_all()?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    let meta = std::fs::symlink_metadata(&path)?;
    #[cfg(unix)]
    {
        // SAFETY: geteuid has no preconditions and cannot fail.
        #[allow(unsafe_code)]
        let me = unsafe { libc::geteuid() };
        if !meta.file_type().is_file() || meta.mode() & 0o077 != 0 || meta.uid() != me {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "{} must be a regular file of this user with mode 0600 (whoever can \
                     read it can forge compiled code the router would run)",
                    path.display()
                ),
            ));
        }
    }
    let key = std::fs::read(&path)?;
    if key.len() != TAG_LEN {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("{} is not a {TAG_LEN}-byte key", path.display()),
        ));
    }
    Ok(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key))
}

/// Layout of a cache file: the HMAC-SHA256 tag of the artifact, then the artifact.
fn store(key: &ring::hmac::Key, path: &Path, artifact: &[u8]) -> std::io::Result<()> {
    let mut data = ring::hmac::sign(key, artifact).as_ref().to_vec();
    data.extend_from_slice(artifact);
    // Write then rename, so a concurrent reader never sees half a file.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &data)?;
    std::fs::rename(&tmp, path)
}

fn deserialize_checked(engine: &Engine, key: &ring::hmac::Key, data: &[u8]) -> Option<Component> {
    if data.len() < TAG_LEN {
        return None;
    }
    let (tag, artifact) = data.split_at(TAG_LEN);
    if ring::hmac::verify(key, artifact, tag).is_err() {
        tracing::warn!(
            "a policy cache entry was not written by this router (its tag does not verify); \
             recompiling"
        );
        return None;
    }
    // SAFETY: `Component::deserialize` requires bytes produced by
    // `Engine::precompile_component` of a compatible engine. Only `store` above writes
    // entries with a tag under this key (which no one else can read), from exactly such
    // bytes, and the file name carries the engine's compatibility hash.
    #[allow(unsafe_code)]
    let component = unsafe { Component::deserialize(engine, artifact) };
    component.ok()
}
