//! A timestamp as the envelope writes it: RFC 3339 in UTC with as many fraction digits as it needs
//! (none, 3, 6 or 9), the text chrono's `to_rfc3339_opts(SecondsFormat::AutoSi, true)` writes,
//! formatted on the stack. The relay writes two per message; chrono's formatter allocates and goes
//! through its general formatting machinery for each.

use chrono::{DateTime, Datelike, SecondsFormat, Timelike, Utc};

/// `YYYY-MM-DDTHH:MM:SS.fffffffffZ` is 30 bytes.
const LONGEST: usize = 30;

/// RFC 3339 text of one timestamp ([`TimestampText::new`]).
#[derive(Clone)]
pub struct TimestampText(Text);

#[derive(Clone)]
enum Text {
    Written {
        bytes: [u8; LONGEST],
        len: u8,
    },
    /// A time chrono writes differently (a year outside 0-9999, a leap second): its own text.
    Chrono(String),
}

impl TimestampText {
    /// The text of `time`, as chrono writes it with `SecondsFormat::AutoSi` and `Z`.
    pub fn new(time: DateTime<Utc>) -> Self {
        let nanos = time.nanosecond();
        if !(0..=9999).contains(&time.year()) || nanos >= 1_000_000_000 {
            // Rare (Postgres has no leap seconds; a year past 9999 is an application's choice):
            // chrono's own text rather than another spelling.
            return Self(Text::Chrono(time.to_rfc3339_opts(SecondsFormat::AutoSi, true)));
        }
        let (date, seconds) = (time.date_naive(), time.num_seconds_from_midnight());
        let mut bytes = [0; LONGEST];
        let b = &mut bytes;
        digits(&mut b[0..4], date.year() as u32);
        b[4] = b'-';
        digits(&mut b[5..7], date.month());
        b[7] = b'-';
        digits(&mut b[8..10], date.day());
        b[10] = b'T';
        digits(&mut b[11..13], seconds / 3600);
        b[13] = b':';
        digits(&mut b[14..16], seconds / 60 % 60);
        b[16] = b':';
        digits(&mut b[17..19], seconds % 60);
        let mut len = 19;
        let fraction = if nanos == 0 {
            None
        } else if nanos.is_multiple_of(1_000_000) {
            Some((nanos / 1_000_000, 3))
        } else if nanos.is_multiple_of(1_000) {
            Some((nanos / 1_000, 6))
        } else {
            Some((nanos, 9))
        };
        if let Some((value, width)) = fraction {
            b[len] = b'.';
            digits(&mut b[len + 1..len + 1 + width], value);
            len += 1 + width;
        }
        b[len] = b'Z';
        Self(Text::Written { bytes, len: (len + 1) as u8 })
    }

    pub fn as_str(&self) -> &str {
        match &self.0 {
            // Only ASCII digits and separators were written.
            Text::Written { bytes, len } => std::str::from_utf8(&bytes[..usize::from(*len)]).expect("ASCII"),
            Text::Chrono(text) => text,
        }
    }
}

/// `value` in decimal, zero-padded to fill `out` (the callers' values fit).
fn digits(out: &mut [u8], mut value: u32) {
    for slot in out.iter_mut().rev() {
        *slot = b'0' + (value % 10) as u8;
        value /= 10;
    }
}

impl std::fmt::Debug for TimestampText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn chrono_text(time: DateTime<Utc>) -> String {
        time.to_rfc3339_opts(SecondsFormat::AutoSi, true)
    }

    #[test]
    fn writes_what_chrono_writes_for_every_fraction_width() {
        let base = Utc.with_ymd_and_hms(2026, 11, 29, 9, 59, 0).unwrap();
        for nanos in [0, 1, 7, 999, 1_000, 120_000, 999_000, 1_000_000, 5_000_000, 123_456_789, 999_999_999] {
            let time = base + chrono::Duration::nanoseconds(nanos);
            assert_eq!(TimestampText::new(time).as_str(), chrono_text(time), "{nanos} ns");
        }
    }

    #[test]
    fn writes_what_chrono_writes_across_the_years_it_covers() {
        // Seeded so a failure is repeatable.
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (first, last) = (
            Utc.with_ymd_and_hms(0, 1, 1, 0, 0, 0).unwrap().timestamp(),
            Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap().timestamp(),
        );
        for i in 0..20_000 {
            let secs = first + (next() % (last - first + 1) as u64) as i64;
            // A quarter each of whole seconds, milliseconds, microseconds and nanoseconds.
            let nanos = match i % 4 {
                0 => 0,
                1 => (next() % 1_000) as u32 * 1_000_000,
                2 => (next() % 1_000_000) as u32 * 1_000,
                _ => (next() % 1_000_000_000) as u32,
            };
            let time = Utc.timestamp_opt(secs, nanos).unwrap();
            assert_eq!(TimestampText::new(time).as_str(), chrono_text(time));
        }
    }

    #[test]
    fn times_chrono_writes_another_way_are_chrono_s_text() {
        let leap = Utc.with_ymd_and_hms(2016, 12, 31, 23, 59, 59).unwrap().with_nanosecond(1_500_000_000).unwrap();
        let far = Utc.with_ymd_and_hms(12_345, 1, 1, 0, 0, 0).unwrap();
        let before = Utc.with_ymd_and_hms(-1, 1, 1, 0, 0, 0).unwrap();
        for time in [leap, far, before] {
            assert_eq!(TimestampText::new(time).as_str(), chrono_text(time));
        }
    }
}
