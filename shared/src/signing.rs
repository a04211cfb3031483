//! Message signatures: the relay signs every envelope with a secret key, the consumer verifies it
//! before anything else, so a publisher that can reach the stream but does not hold a key cannot
//! have a task created.
//!
//! **HMAC-SHA256**, with a key id so keys can be rotated. Chosen over Ed25519 because both ends are
//! handoff's own services, deployed by one team from one secret store, so a shared secret gives
//! up nothing an asymmetric key would protect in this shape, and it costs about a microsecond per
//! message on either side where an Ed25519 signature costs tens (the relay moves tens of thousands
//! of rows a second; see docs/benchmarks.md). The price, stated plainly: whoever holds a verify
//! key can also sign, so verify key files are secrets exactly like the signing key.
//!
//! A key file holds one line, `hmac-sha256:<key id>:<64 hex digits>` (comment lines start with
//! `#`); `handoff-admin keygen` writes a new pair. Rotation: add the new verify key to every
//! consumer, switch the relays to the new signing key, and remove the old verify key once no
//! message signed with it is left unconsumed.
//!
//! What is signed: every envelope attribute except `data`, each length-prefixed, including the
//! key id (see [`SignedFields`]); `data` is bound through `handoffhash`, which the consumer
//! recomputes from the data.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The only algorithm this build signs with; the prefix of every key file line.
pub const ALGORITHM: &str = "hmac-sha256";
/// Bytes of secret in a generated key.
pub const SECRET_LEN: usize = 32;
/// Longest key id accepted.
pub const MAX_KEY_ID_LEN: usize = 64;
/// Domain separation: a signature over handoff envelope attributes, this layout.
const CONTEXT: &[u8] = b"handoff envelope signature 1";

type HmacSha256 = Hmac<Sha256>;

/// A key's name, carried in every signed message (`handoffkeyid`): letters, digits, `.`, `_`, `-`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KeyId(String);

impl KeyId {
    /// Validates a key id.
    pub fn new(id: &str) -> Result<Self, KeyFileError> {
        let valid = !id.is_empty()
            && id.len() <= MAX_KEY_ID_LEN
            && id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if valid { Ok(Self(id.to_owned())) } else { Err(KeyFileError::BadKeyId(id.chars().take(80).collect())) }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for KeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A secret key with its id. Its `Debug` shows the id only.
#[derive(Clone)]
pub struct SigningKey {
    id: KeyId,
    secret: Vec<u8>,
    /// HMAC keyed with `secret`, before any message: cloned for each signature instead of
    /// hashing the key's pads again.
    keyed: HmacSha256,
}

impl PartialEq for SigningKey {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id && self.secret == other.secret
    }
}

impl Eq for SigningKey {}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey").field("id", &self.id).finish_non_exhaustive()
    }
}

/// Why a key file (or key) cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("cannot read key file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write key file {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} already exists; a key file is never overwritten (move it away first)")]
    Exists { path: PathBuf },
    #[error(
        "key file {path} must hold exactly one line `{ALGORITHM}:<key id>:<hex secret>` (and # comments): {problem}"
    )]
    Format { path: PathBuf, problem: &'static str },
    #[error("key id {0:?} is not 1-{MAX_KEY_ID_LEN} letters, digits, '.', '_' or '-'")]
    BadKeyId(String),
    #[error("the secret must be at least {SECRET_LEN} bytes")]
    ShortSecret,
    #[error("key id {id} is listed twice with different secrets ({first} and {second})")]
    Conflicting { id: KeyId, first: PathBuf, second: PathBuf },
    #[error("the operating system's random source failed")]
    Random(#[source] rand::rand_core::OsError),
}

impl SigningKey {
    /// A key from its parts; the secret must be at least [`SECRET_LEN`] bytes.
    pub fn new(id: KeyId, secret: Vec<u8>) -> Result<Self, KeyFileError> {
        if secret.len() < SECRET_LEN {
            return Err(KeyFileError::ShortSecret);
        }
        let keyed = HmacSha256::new_from_slice(&secret).expect("HMAC accepts any key length");
        Ok(Self { id, secret, keyed })
    }

    /// A new random key from the operating system's random source. Without an id, the id is
    /// `k` and the first 12 hex digits of a hash of the secret (a fingerprint: it names the key
    /// without revealing it).
    pub fn generate(id: Option<KeyId>) -> Result<Self, KeyFileError> {
        use rand::TryRngCore;
        let mut secret = vec![0u8; SECRET_LEN];
        rand::rngs::OsRng.try_fill_bytes(&mut secret).map_err(KeyFileError::Random)?;
        let id = match id {
            Some(id) => id,
            None => {
                let fingerprint = Sha256::new_with_prefix(b"handoff key id").chain_update(&secret).finalize();
                KeyId(format!("k{}", &hex::encode(fingerprint)[..12]))
            }
        };
        Self::new(id, secret)
    }

    pub fn id(&self) -> &KeyId {
        &self.id
    }

    /// The key file line.
    fn line(&self) -> String {
        format!("{ALGORITHM}:{}:{}", self.id, hex::encode(&self.secret))
    }

    /// Parses a key file's text (`path` only names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<Self, KeyFileError> {
        let format = |problem| KeyFileError::Format { path: path.to_owned(), problem };
        let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#'));
        let line = lines.next().ok_or_else(|| format("no key line"))?;
        if lines.next().is_some() {
            return Err(format("more than one key line"));
        }
        let mut parts = line.splitn(3, ':');
        let (algorithm, id, secret) = match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(i), Some(s)) => (a, i, s),
            _ => return Err(format("not three fields separated by ':'")),
        };
        if algorithm != ALGORITHM {
            return Err(format("unknown algorithm (this build knows hmac-sha256)"));
        }
        let secret = hex::decode(secret).map_err(|_| format("the secret is not hex"))?;
        Self::new(KeyId::new(id)?, secret)
    }

    /// Reads a key file.
    pub fn read(path: &Path) -> Result<Self, KeyFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| KeyFileError::Read { path: path.into(), source })?;
        Self::parse(&text, path)
    }

    /// Writes this key to a new file readable by its owner only; an existing file is an error.
    pub fn write(&self, path: &Path, role: &str) -> Result<(), KeyFileError> {
        use std::io::Write;
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(path).map_err(|source| match source.kind() {
            std::io::ErrorKind::AlreadyExists => KeyFileError::Exists { path: path.into() },
            _ => KeyFileError::Write { path: path.into(), source },
        })?;
        let text = format!(
            "# handoff {role} key {id} ({ALGORITHM}). A secret: whoever holds it can sign messages.\n{line}\n",
            id = self.id,
            line = self.line()
        );
        file.write_all(text.as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(|source| KeyFileError::Write { path: path.into(), source })
    }

    /// The signature of `fields` under this key, as hex.
    pub fn sign(&self, fields: &SignedFields<'_>) -> String {
        self.sign_into(fields, &mut [0; 64]).to_owned()
    }

    /// [`SigningKey::sign`] written into `text` (no allocation per message).
    pub fn sign_into<'t>(&self, fields: &SignedFields<'_>, text: &'t mut [u8; 64]) -> &'t str {
        hex::encode_to_slice(self.mac(fields).finalize().into_bytes(), text).expect("32 bytes are 64 hex digits");
        std::str::from_utf8(text).expect("hex digits are ASCII")
    }

    fn mac(&self, fields: &SignedFields<'_>) -> HmacSha256 {
        let mut mac = self.keyed.clone();
        fields.feed(self.id.as_str(), &mut mac);
        mac
    }

    fn verifies(&self, fields: &SignedFields<'_>, signature: &str) -> bool {
        hex::decode(signature).is_ok_and(|bytes| self.mac(fields).verify_slice(&bytes).is_ok())
    }
}

/// The envelope attributes a signature covers, as they appear on the wire.
#[derive(Debug, Clone, Copy)]
pub struct SignedFields<'a> {
    pub id: &'a str,
    pub source: &'a str,
    pub kind: &'a str,
    pub time: &'a str,
    pub datacontenttype: &'a str,
    pub hash: &'a str,
    pub approved_by: &'a str,
    pub approved_at: &'a str,
    pub schema: u32,
    pub traceparent: Option<&'a str>,
}

impl SignedFields<'_> {
    /// Each field length-prefixed, so no two different attribute sets feed the same bytes.
    fn feed(&self, key_id: &str, mac: &mut HmacSha256) {
        let schema = self.schema.to_string();
        for field in [
            CONTEXT,
            key_id.as_bytes(),
            self.id.as_bytes(),
            self.source.as_bytes(),
            self.kind.as_bytes(),
            self.time.as_bytes(),
            self.datacontenttype.as_bytes(),
            self.hash.as_bytes(),
            self.approved_by.as_bytes(),
            self.approved_at.as_bytes(),
            schema.as_bytes(),
            self.traceparent.unwrap_or("").as_bytes(),
        ] {
            mac.update(&(field.len() as u64).to_be_bytes());
            mac.update(field);
        }
    }
}

/// Why a message's signature is refused. Permanent: the consumer dead-letters the message with
/// this reason (a message refused for an unknown key can be replayed once the key is added).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error(
        "message is not signed (no handoffsig attribute); unsigned messages are refused unless the consumer runs with --allow-unsigned"
    )]
    Unsigned,
    #[error("message has a signature but no key id (handoffkeyid)")]
    NoKeyId,
    #[error(
        "message is signed with key {found:?}, which is not among the verify keys ({known}); if keys are being rotated, add its verify key and replay the dead letters"
    )]
    UnknownKey { found: String, known: String },
    #[error("signature does not verify with key {0}: the message was forged or altered after signing")]
    BadSignature(KeyId),
}

/// What a consumer accepts: messages signed by any of its verify keys, and unsigned ones only
/// when told to (while producers are being moved to signing).
#[derive(Debug, Clone, Default)]
pub struct SignaturePolicy {
    keys: BTreeMap<KeyId, SigningKey>,
    allow_unsigned: bool,
}

/// How a message passed the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signed {
    /// Verified with this key.
    By(KeyId),
    /// Not signed, accepted because the policy allows unsigned messages.
    Unsigned,
}

impl SignaturePolicy {
    /// Accepts messages signed with any of `keys` (and unsigned ones if `allow_unsigned`). Two
    /// keys with one id must hold the same secret.
    pub fn new(keys: impl IntoIterator<Item = SigningKey>, allow_unsigned: bool) -> Result<Self, KeyFileError> {
        Self::from_files(keys.into_iter().map(|k| (PathBuf::new(), k)), allow_unsigned)
    }

    /// Like [`SignaturePolicy::new`], with the file each key came from (named in errors).
    pub fn from_files(
        keys: impl IntoIterator<Item = (PathBuf, SigningKey)>,
        allow_unsigned: bool,
    ) -> Result<Self, KeyFileError> {
        let mut found: BTreeMap<KeyId, (PathBuf, SigningKey)> = BTreeMap::new();
        for (path, key) in keys {
            if let Some((first, existing)) = found.get(&key.id) {
                if existing.secret != key.secret {
                    return Err(KeyFileError::Conflicting { id: key.id, first: first.clone(), second: path });
                }
                continue;
            }
            found.insert(key.id.clone(), (path, key));
        }
        Ok(Self { keys: found.into_iter().map(|(id, (_, key))| (id, key)).collect(), allow_unsigned })
    }

    /// Reads every verify key file in `paths`.
    pub fn read(paths: &[PathBuf], allow_unsigned: bool) -> Result<Self, KeyFileError> {
        let keys = paths.iter().map(|p| SigningKey::read(p).map(|k| (p.clone(), k))).collect::<Result<Vec<_>, _>>()?;
        Self::from_files(keys, allow_unsigned)
    }

    /// Accepts anything, signed or not, without checking: for tools that read the stream (never
    /// for the consumer).
    pub fn unchecked() -> Self {
        Self { keys: BTreeMap::new(), allow_unsigned: true }
    }

    /// The verify key ids, in order.
    pub fn key_ids(&self) -> impl Iterator<Item = &KeyId> {
        self.keys.keys()
    }

    pub fn allows_unsigned(&self) -> bool {
        self.allow_unsigned
    }

    /// Checks one message's key id and signature over `fields`.
    pub fn check(
        &self,
        fields: &SignedFields<'_>,
        key_id: Option<&str>,
        signature: Option<&str>,
    ) -> Result<Signed, SignatureError> {
        let Some(signature) = signature else {
            return if self.allow_unsigned { Ok(Signed::Unsigned) } else { Err(SignatureError::Unsigned) };
        };
        let key_id = key_id.ok_or(SignatureError::NoKeyId)?;
        let key = self.keys.iter().find(|(id, _)| id.as_str() == key_id).map(|(_, key)| key);
        let Some(key) = key else {
            if self.keys.is_empty() && self.allow_unsigned {
                // Unchecked (a tool), or a consumer migrating before it has keys: unverified.
                return Ok(Signed::Unsigned);
            }
            let known = self.keys.keys().map(KeyId::as_str).collect::<Vec<_>>().join(", ");
            return Err(SignatureError::UnknownKey {
                found: key_id.chars().take(80).collect(),
                known: if known.is_empty() { "none".into() } else { known },
            });
        };
        if key.verifies(fields, signature) {
            Ok(Signed::By(key.id.clone()))
        } else {
            Err(SignatureError::BadSignature(key.id.clone()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields() -> SignedFields<'static> {
        SignedFields {
            id: "harbor:create-followup:v1:case-104",
            source: "/handoff/relay",
            kind: "harbor.create-followup.v1",
            time: "2026-11-29T10:00:00Z",
            datacontenttype: "application/json",
            hash: "ab",
            approved_by: "u-17",
            approved_at: "2026-11-29T09:59:00Z",
            schema: 1,
            traceparent: None,
        }
    }

    #[test]
    fn a_signature_verifies_with_its_key_only_and_covers_every_field() {
        let key = SigningKey::generate(None).unwrap();
        let other = SigningKey::generate(Some(KeyId::new(key.id().as_str()).unwrap())).unwrap();
        let sig = key.sign(&fields());
        let policy = SignaturePolicy::new([key.clone()], false).unwrap();
        assert_eq!(policy.check(&fields(), Some(key.id().as_str()), Some(&sig)), Ok(Signed::By(key.id().clone())));
        let impostor = SignaturePolicy::new([other], false).unwrap();
        assert!(matches!(
            impostor.check(&fields(), Some(key.id().as_str()), Some(&sig)),
            Err(SignatureError::BadSignature(_))
        ));
        let changed = [
            SignedFields { id: "harbor:create-followup:v1:case-105", ..fields() },
            SignedFields { approved_by: "u-18", ..fields() },
            SignedFields { hash: "ac", ..fields() },
            SignedFields { schema: 2, ..fields() },
            fields().with_traceparent("x"),
            // Moving bytes between adjacent fields changes the signature too.
            SignedFields { source: "/handoff/relayh", kind: "arbor.create-followup.v1", ..fields() },
        ];
        for fields in changed {
            assert!(policy.check(&fields, Some(key.id().as_str()), Some(&sig)).is_err(), "{fields:?}");
        }
    }

    impl<'a> SignedFields<'a> {
        fn with_traceparent(self, tp: &'a str) -> Self {
            Self { traceparent: Some(tp), ..self }
        }
    }

    #[test]
    fn unsigned_and_unknown_keys_are_refused_unless_unsigned_is_allowed() {
        let key = SigningKey::generate(Some(KeyId::new("k-2026").unwrap())).unwrap();
        let strict = SignaturePolicy::new([key.clone()], false).unwrap();
        assert_eq!(strict.check(&fields(), None, None), Err(SignatureError::Unsigned));
        let error = strict.check(&fields(), Some("k-old"), Some("00")).unwrap_err();
        assert!(error.to_string().contains("\"k-old\"") && error.to_string().contains("k-2026"), "{error}");
        let migrating = SignaturePolicy::new([key.clone()], true).unwrap();
        assert_eq!(migrating.check(&fields(), None, None), Ok(Signed::Unsigned));
        assert!(
            matches!(migrating.check(&fields(), Some("k-2026"), Some("00")), Err(SignatureError::BadSignature(_))),
            "a bad signature is refused even while unsigned messages are allowed"
        );
        assert_eq!(SignaturePolicy::default().check(&fields(), None, None), Err(SignatureError::Unsigned));
    }

    #[test]
    fn key_files_round_trip_are_never_overwritten_and_bad_ones_are_named() {
        let dir = std::env::temp_dir().join(format!("handoff-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("signing.key");
        let _ = std::fs::remove_file(&path);
        let key = SigningKey::generate(None).unwrap();
        assert!(key.id().as_str().starts_with('k') && key.id().as_str().len() == 13);
        key.write(&path, "signing").unwrap();
        assert_eq!(SigningKey::read(&path).unwrap(), key);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        }
        assert!(matches!(key.write(&path, "signing"), Err(KeyFileError::Exists { .. })));
        assert!(!format!("{key:?}").contains(&hex::encode(&key.secret)), "Debug hides the secret");
        for (text, expected) in [
            ("", "no key line"),
            ("hmac-sha256:a:00\nhmac-sha256:b:00", "more than one"),
            ("ed25519:a:00", "unknown algorithm"),
            ("hmac-sha256:a:zz", "not hex"),
        ] {
            let error = SigningKey::parse(text, &path).unwrap_err().to_string();
            assert!(error.contains(expected) && error.contains("signing.key"), "{error}");
        }
        assert!(matches!(SigningKey::parse("hmac-sha256:a:00", &path), Err(KeyFileError::ShortSecret)));
        assert!(matches!(
            SigningKey::parse(&format!("hmac-sha256:a b:{}", "0".repeat(64)), &path),
            Err(KeyFileError::BadKeyId(_))
        ));
        let twin = SigningKey::new(key.id().clone(), vec![7; SECRET_LEN]).unwrap();
        assert!(matches!(SignaturePolicy::new([key.clone(), twin], false), Err(KeyFileError::Conflicting { .. })));
        assert_eq!(SignaturePolicy::new([key.clone(), key.clone()], false).unwrap().key_ids().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
