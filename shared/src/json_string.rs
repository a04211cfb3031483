//! JSON strings as serde_json writes them, which is also how RFC 8785 writes them: the envelope's
//! attributes and the canonical payload's strings and member names, several per message.

/// `text` as a JSON string, escaped as serde_json escapes it: `"`, `\\` and the control characters
/// below U+0020 (the common ones by letter, the rest as `\u00xx`), everything else as it is.
pub(crate) fn write_json_string(out: &mut Vec<u8>, text: &str) {
    out.push(b'"');
    let bytes = text.as_bytes();
    // Almost every string needs no escape: find out without branching per byte (vectorized).
    if !bytes.iter().fold(false, |any, &b| any | (b < 0x20) | (b == b'"') | (b == b'\\')) {
        out.extend_from_slice(bytes);
        out.push(b'"');
        return;
    }
    let mut plain = 0;
    for (i, &byte) in bytes.iter().enumerate() {
        let escape: &[u8] = match byte {
            b'"' => br#"\""#,
            b'\\' => br"\\",
            b'\n' => br"\n",
            b'\r' => br"\r",
            b'\t' => br"\t",
            0x08 => br"\b",
            0x0c => br"\f",
            0x00..=0x1f => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(&bytes[plain..i]);
                out.extend_from_slice(&[
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    HEX[usize::from(byte >> 4)],
                    HEX[usize::from(byte & 0xf)],
                ]);
                plain = i + 1;
                continue;
            }
            _ => continue,
        };
        out.extend_from_slice(&bytes[plain..i]);
        out.extend_from_slice(escape);
        plain = i + 1;
    }
    out.extend_from_slice(&bytes[plain..]);
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_what_serde_json_writes_for_every_character_class() {
        let mut texts: Vec<String> = (0u8..0x80).map(|b| format!("a{}b", b as char)).collect();
        texts.extend(["", "plain", "\"\\", "é€😀", "\u{7f}/", "\n\r\t\u{8}\u{c}\u{0}\u{1f}x"].map(String::from));
        for text in &texts {
            let mut written = Vec::new();
            write_json_string(&mut written, text);
            assert_eq!(written, serde_json::to_vec(text).unwrap(), "{text:?}");
        }
    }
}
