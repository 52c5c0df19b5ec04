//! The duration syntax of every baton flag: `500ms`, `2s`, `1m`, `1.5s`, `1m30s`.

use std::time::Duration;

/// Why a duration string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// The string was empty.
    #[error("empty duration")]
    Empty,
    /// A number had no unit after it.
    #[error("duration {0:?} needs a unit: use ms, s, m or h (for example 500ms, 2s, 1m)")]
    MissingUnit(String),
    /// An unknown unit followed a number.
    #[error("duration {input:?} has unknown unit {unit:?}: use ms, s, m or h")]
    UnknownUnit {
        /// The whole input.
        input: String,
        /// The unit found.
        unit: String,
    },
    /// Something that is not a number stood where one was expected.
    #[error("duration {0:?} is not a number followed by a unit (for example 500ms, 2s, 1m)")]
    Malformed(String),
    /// The value does not fit.
    #[error("duration {0:?} is too large")]
    Overflow(String),
}

/// Parses `500ms`, `2s`, `1m`, `1h`, `1.5s`, `1m30s`, `250us`.
///
/// A bare number is rejected: `--ttl 10` could mean seconds or milliseconds, and guessing wrong
/// changes how long a dead leader blocks failover.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let text = input.trim();
    if text.is_empty() {
        return Err(DurationError::Empty);
    }
    let mut rest = text;
    let mut total_nanos: u128 = 0;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if number_len == 0 {
            return Err(DurationError::Malformed(input.to_string()));
        }
        let (number, after) = rest.split_at(number_len);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_len);
        if unit.is_empty() {
            return Err(DurationError::MissingUnit(input.to_string()));
        }
        let unit_nanos: u128 = match unit {
            "ns" => 1,
            "us" | "µs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => {
                return Err(DurationError::UnknownUnit {
                    input: input.to_string(),
                    unit: unit.to_string(),
                })
            }
        };
        total_nanos = total_nanos
            .checked_add(scale(number, unit_nanos, input)?)
            .ok_or_else(|| DurationError::Overflow(input.to_string()))?;
        rest = next;
    }
    let nanos =
        u64::try_from(total_nanos).map_err(|_| DurationError::Overflow(input.to_string()))?;
    Ok(Duration::from_nanos(nanos))
}

/// `number` × `unit_nanos`, exact for up to nine decimal places.
fn scale(number: &str, unit_nanos: u128, input: &str) -> Result<u128, DurationError> {
    let malformed = || DurationError::Malformed(input.to_string());
    let overflow = || DurationError::Overflow(input.to_string());
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') || fraction.len() > 9 {
        return Err(malformed());
    }
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| overflow())?
    };
    let mut value = whole.checked_mul(unit_nanos).ok_or_else(overflow)?;
    if !fraction.is_empty() {
        let digits: u128 = fraction.parse().map_err(|_| malformed())?;
        let denominator = 10u128.pow(fraction.len() as u32);
        value = value
            .checked_add(digits * unit_nanos / denominator)
            .ok_or_else(overflow)?;
    }
    Ok(value)
}

/// Formats a duration in the same syntax, choosing the largest exact unit (`2s`, `1500ms`).
pub fn format_duration(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    for (unit, size) in [
        ("h", 3_600_000_000_000u128),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
        ("us", 1_000),
    ] {
        if nanos >= size && nanos % size == 0 {
            return format!("{}{unit}", nanos / size);
        }
    }
    format!("{nanos}ns")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_forms() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration(" 250us "), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn rejects_ambiguous_and_malformed_input() {
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert!(matches!(
            parse_duration("10"),
            Err(DurationError::MissingUnit(_))
        ));
        assert!(matches!(
            parse_duration("10days"),
            Err(DurationError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_duration("s"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            parse_duration("1.2.3s"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            parse_duration("-1s"),
            Err(DurationError::Malformed(_))
        ));
        assert!(matches!(
            parse_duration("99999999999999999999h"),
            Err(DurationError::Overflow(_))
        ));
        let message = parse_duration("10").unwrap_err().to_string();
        assert!(message.contains("needs a unit"), "{message}");
    }

    #[test]
    fn formats_round_trip() {
        for text in ["2s", "1500ms", "1m", "250us", "7ns", "1h"] {
            let parsed = parse_duration(text).unwrap();
            assert_eq!(format_duration(parsed), text);
        }
    }
}
