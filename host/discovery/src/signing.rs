//! Signed policy pushes: an ed25519 key pair per operator (or per CI job) that signs what
//! `switchyard policy push --sign` stores in etcd, and the public keys a router trusts
//! (`--policy-trusted-key`). A router with trusted keys applies a pushed policy only if
//! one of them signed exactly this policy, this configuration, for this endpoint:
//! whoever can write etcd's policy keys, but holds no trusted private key, cannot change
//! the routing of any router that requires signatures.
//!
//! Files: the private key is the base64 of its PKCS#8 document on one line, mode 0600
//! (refused if others may read it); the public key is the base64 of its 32 bytes on one
//! line (`NAME.pub` beside the private key).

use std::path::{Path, PathBuf};

use base64::Engine as _;
use ring::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};

/// A public key a router trusts.
#[derive(Clone, PartialEq, Eq)]
pub struct PublicKey([u8; 32]);

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

impl std::fmt::Display for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&b64().encode(self.0))
    }
}

impl std::str::FromStr for PublicKey {
    type Err = String;

    fn from_str(text: &str) -> Result<PublicKey, String> {
        let bytes = b64()
            .decode(text.trim())
            .map_err(|e| format!("not base64: {e}"))?;
        let key: [u8; 32] = bytes
            .try_into()
            .map_err(|b: Vec<u8>| format!("{} bytes, not the 32 of an ed25519 key", b.len()))?;
        Ok(PublicKey(key))
    }
}

/// A key file's size bound: an ed25519 key in base64 is under a hundred bytes.
const MAX_KEY_FILE: u64 = 64 << 10;

impl PublicKey {
    /// Reads a `.pub` file.
    pub fn load(path: &Path) -> Result<PublicKey, String> {
        let text = switchyard_bounded::files::read_to_string(path, MAX_KEY_FILE)
            .map_err(|e| format!("cannot read the public key {}: {e}", path.display()))?;
        text.parse()
            .map_err(|e| format!("{} is not an ed25519 public key: {e}", path.display()))
    }

    /// Whether `signature` is this key's signature of `message`.
    pub fn verifies(&self, message: &[u8], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(&ED25519, &self.0)
            .verify(message, signature)
            .is_ok()
    }
}

/// A private key that signs pushes.
pub struct SigningKey(Ed25519KeyPair);

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SigningKey(public {})", self.public())
    }
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

impl SigningKey {
    /// Makes a new key pair: the private key at `path` (created, never overwritten, mode
    /// 0600) and the public key at `path.pub`. Returns the public key.
    pub fn generate(path: &Path) -> Result<PublicKey, String> {
        use std::io::Write;
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng)
            .map_err(|_| "no system randomness to make a key".to_string())?;
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref())
            .map_err(|e| format!("the new key does not parse: {e}"))?;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options
            .open(path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        writeln!(file, "{}", b64().encode(pkcs8.as_ref()))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        let public = SigningKey(pair).public();
        std::fs::write(public_path(path), format!("{public}\n"))
            .map_err(|e| format!("cannot write {}: {e}", public_path(path).display()))?;
        Ok(public)
    }

    /// Reads a private key file; refuses one that others may read.
    pub fn load(path: &Path) -> Result<SigningKey, String> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            let meta = std::fs::metadata(path)
                .map_err(|e| format!("cannot read the signing key {}: {e}", path.display()))?;
            if meta.mode() & 0o077 != 0 {
                return Err(format!(
                    "the signing key {} may be read by others (mode {:o}); chmod 600 it",
                    path.display(),
                    meta.mode() & 0o777
                ));
            }
        }
        let text = switchyard_bounded::files::read_to_string(path, MAX_KEY_FILE)
            .map_err(|e| format!("cannot read the signing key {}: {e}", path.display()))?;
        let der = b64()
            .decode(text.trim())
            .map_err(|e| format!("{} is not a signing key (not base64: {e})", path.display()))?;
        Ed25519KeyPair::from_pkcs8_maybe_unchecked(&der)
            .map(SigningKey)
            .map_err(|e| format!("{} is not an ed25519 signing key: {e}", path.display()))
    }

    /// Its public key.
    pub fn public(&self) -> PublicKey {
        let mut key = [0u8; 32];
        key.copy_from_slice(self.0.public_key().as_ref());
        PublicKey(key)
    }

    /// Signs `message`.
    pub fn sign(&self, message: &[u8]) -> Vec<u8> {
        self.0.sign(message).as_ref().to_vec()
    }
}

/// Where `generate` writes the public key of the private key at `path`.
pub fn public_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".pub");
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_key_signs_what_its_public_key_verifies_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ops");
        let public = SigningKey::generate(&path).unwrap();
        assert_eq!(PublicKey::load(&public_path(&path)).unwrap(), public);
        assert!(
            SigningKey::generate(&path).is_err(),
            "an existing key is never overwritten"
        );
        let key = SigningKey::load(&path).unwrap();
        let sig = key.sign(b"message");
        assert!(public.verifies(b"message", &sig));
        assert!(!public.verifies(b"messagE", &sig));
        let other = SigningKey::generate(&dir.path().join("other")).unwrap();
        assert!(!other.verifies(b"message", &sig));

        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = SigningKey::load(&path).unwrap_err();
        assert!(err.contains("chmod 600"), "{err}");
        assert!("AAAA".parse::<PublicKey>().is_err());
    }
}
