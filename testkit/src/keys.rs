//! A message signing key pair for a test: in memory, and in files for the binaries, in a
//! temporary directory removed with it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use handoff_shared::signing::{SignaturePolicy, SigningKey};

/// A signing key and the files holding it (written by the same code as `handoff-admin keygen`).
#[derive(Debug)]
pub struct Keys {
    pub signing: SigningKey,
    /// For `HANDOFF_SIGNING_KEY_FILE`.
    pub signing_file: PathBuf,
    /// For `HANDOFF_VERIFY_KEY_FILES` (HMAC: the same secret).
    pub verify_file: PathBuf,
    dir: PathBuf,
}

impl Keys {
    /// A new random key pair in a new temporary directory.
    pub fn generate() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("handoff-keys-{}-{:08x}", std::process::id(), crate::unique_u32()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let signing = SigningKey::generate(None)?;
        let (signing_file, verify_file) = (dir.join("signing.key"), dir.join("verify.key"));
        signing.write(&signing_file, "signing")?;
        signing.write(&verify_file, "verify")?;
        Ok(Self { signing, signing_file, verify_file, dir })
    }

    /// The directory the key files are in (a test may put more files there).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What a consumer that verifies this key, and only it, accepts.
    pub fn policy(&self) -> SignaturePolicy {
        SignaturePolicy::new([self.signing.clone()], false).expect("a single key cannot conflict")
    }
}

impl Drop for Keys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
