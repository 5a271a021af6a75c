//! On-disk cache of compiled policies.
//!
//! `Component::new` costs tens of milliseconds; loading precompiled code costs a fraction
//! of one. Entries are keyed by the policy's sha256 *and* the engine's compatibility hash
//! (wasmtime version, target, settings), so an upgraded host never loads stale code.
//!
//! Loading compiled code runs it outside the sandbox, so an entry is trusted only if
//! this router wrote it *for this policy*: each carries an HMAC-SHA256, under a key kept
//! in the cache directory (`key`, 32 random bytes, created mode 0600 on first use), of
//! the sha256 of the `.wasm` it was compiled from, the engine's compatibility hash and
//! the compiled bytes. An entry whose tag does not verify (truncated, altered, written
//! by someone without the key, or another policy's entry copied over this one's name) is
//! recompiled, never executed.
//!
//! The directory must be this user's and not writable by group or others, and every file
//! in it is opened without following symbolic links, checked on the opened descriptor
//! (a regular file of this user), and created exclusively: a writer of the directory
//! could otherwise redirect the router's writes or swap in a key between a check and a
//! read. A directory or key that fails these checks is not used at all, and the router
//! says why.

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
    let engine_key = engine_key(engine);
    let path = dir.join(format!("{sha256}-{engine_key}.cwasm"));
    let origin = Origin {
        sha256,
        engine: &engine_key,
    };
    if let Ok(entry) = read_checked(&path, MAX_ENTRY, false)
        && let Some(component) = deserialize_checked(engine, &key, origin, &entry)
    {
        return Ok((component, CacheOutcome::Disk));
    }
    // Compiled once: the artifact is both stored and loaded.
    let artifact = engine.precompile_component(bytes)?;
    // SAFETY: `artifact` was produced just above by `precompile_component` of this same
    // engine, which is exactly what `Component::deserialize` requires.
    #[allow(unsafe_code)]
    let component = unsafe { Component::deserialize(engine, &artifact) }?;
    if let Err(e) = store(&key, origin, &path, &artifact) {
        tracing::warn!(path = %path.display(), error = %e, "cannot write the policy cache");
    }
    Ok((component, CacheOutcome::Compiled))
}

/// Length of an entry's tag (HMAC-SHA256).
const TAG_LEN: usize = 32;

/// Largest cache entry read (compiled policies are a few MiB).
const MAX_ENTRY: u64 = 512 << 20;

/// What an entry was compiled from, covered by its tag.
#[derive(Clone, Copy)]
struct Origin<'a> {
    /// The sha256 of the `.wasm`, hex.
    sha256: &'a str,
    /// The engine's compatibility hash, hex.
    engine: &'a str,
}

impl Origin<'_> {
    /// The tag of `artifact` compiled from this origin.
    fn tag(&self, key: &ring::hmac::Key, artifact: &[u8]) -> ring::hmac::Tag {
        let mut ctx = ring::hmac::Context::with_key(key);
        ctx.update(b"switchyard policy cache v2\0");
        ctx.update(self.sha256.as_bytes());
        ctx.update(b"\0");
        ctx.update(self.engine.as_bytes());
        ctx.update(b"\0");
        ctx.update(artifact);
        ctx.sign()
    }
}

#[cfg(unix)]
fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    #[allow(unsafe_code)]
    unsafe {
        libc::geteuid()
    }
}

/// Reads a file of the cache directory: opened without following a symbolic link,
/// checked on the opened descriptor (a regular file of this user, and with `private`,
/// readable by no one else), at most `max` bytes.
fn read_checked(path: &Path, max: u64, private: bool) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind, Read};
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NOFOLLOW);
    }
    let file = options.open(path)?;
    let meta = file.metadata()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let open = private && meta.mode() & 0o077 != 0;
        if !meta.file_type().is_file() || meta.uid() != my_uid() || open {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "{} must be a regular file of this user{} (whoever can read or write it \
                     can forge compiled code the router would run)",
                    path.display(),
                    if private { " with mode 0600" } else { "" }
                ),
            ));
        }
    }
    if meta.len() > max {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("{} is larger than {max} bytes", path.display()),
        ));
    }
    let mut data = Vec::new();
    file.take(max).read_to_end(&mut data)?;
    Ok(data)
}

/// Creates `path` exclusively (never through an existing file or link), mode 0600,
/// holding `data`, synced.
fn create_new(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600).custom_flags(libc::O_NOFOLLOW);
    }
    let mut file = options.open(path)?;
    file.write_all(data)?;
    file.sync_all()
}

/// The cache directory, created 0700 if missing; refused unless it is a directory of
/// this user that group and others cannot write.
fn check_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder.create(dir)?;
    let meta = std::fs::symlink_metadata(dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if !meta.file_type().is_dir() || meta.uid() != my_uid() || meta.mode() & 0o022 != 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "{} must be a directory of this user that group and others cannot write \
                     (whoever can write it can replace the router's compiled code)",
                    dir.display()
                ),
            ));
        }
    }
    Ok(())
}

/// The cache's HMAC key: read from `dir/key`, or created there (0600, exclusively) on
/// first use. Refused if it is not 32 bytes, not this user's alone, or the directory is
/// not this user's and closed to others.
fn cache_key(dir: &Path) -> std::io::Result<ring::hmac::Key> {
    use std::io::{Error, ErrorKind};
    check_dir(dir)?;
    let path = dir.join("key");
    let key = match read_checked(&path, TAG_LEN as u64, true) {
        Ok(key) => key,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let mut fresh = [0u8; TAG_LEN];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut fresh)
                .map_err(|_| Error::other("no system randomness for the cache key"))?;
            // Written whole under another name, then linked into place: a router starting
            // at the same moment sees no key or the whole key, and one key wins.
            let tmp = dir.join(format!("key.tmp{}", std::process::id()));
            let _ = std::fs::remove_file(&tmp);
            create_new(&tmp, &fresh)?;
            let linked = std::fs::hard_link(&tmp, &path);
            let _ = std::fs::remove_file(&tmp);
            match linked {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            read_checked(&path, TAG_LEN as u64, true)?
        }
        Err(e) => return Err(e),
    };
    if key.len() != TAG_LEN {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("{} is not a {TAG_LEN}-byte key", path.display()),
        ));
    }
    Ok(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key))
}

/// Layout of a cache file: the tag (HMAC-SHA256 of the origin and the artifact), then
/// the artifact.
fn store(
    key: &ring::hmac::Key,
    origin: Origin<'_>,
    path: &Path,
    artifact: &[u8],
) -> std::io::Result<()> {
    let mut data = origin.tag(key, artifact).as_ref().to_vec();
    data.extend_from_slice(artifact);
    // Created exclusively under another name, then renamed (which replaces a link at
    // `path` rather than writing through it), so a concurrent reader never sees half a
    // file.
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    create_new(&tmp, &data)?;
    std::fs::rename(&tmp, path)
}

fn deserialize_checked(
    engine: &Engine,
    key: &ring::hmac::Key,
    origin: Origin<'_>,
    data: &[u8],
) -> Option<Component> {
    if data.len() < TAG_LEN {
        return None;
    }
    let (tag, artifact) = data.split_at(TAG_LEN);
    let expected = origin.tag(key, artifact);
    // Every byte compared, whatever the first difference (no early exit to time).
    let differs = expected
        .as_ref()
        .iter()
        .zip(tag)
        .fold(0u8, |acc, (x, y)| acc | (x ^ y));
    if differs != 0 {
        tracing::warn!(
            "a policy cache entry was not written by this router for this policy (its tag \
             does not verify); recompiling"
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
