//! Pulling the salient number out of an agent's response.
//!
//! Downstream tasks often need "the number" a predecessor computed (a growth rate, a margin)
//! without parsing prose, so every result carries `numeric_value`. The rule, in order:
//!
//! 1. the first percentage (`15.3%`, `15.3 ％`, `15.3 percent`);
//! 2. otherwise the first currency amount (`$1,234.5bn`, `€12`, `1200 USD`);
//! 3. otherwise the last plain number in the text (conclusions come last).
//!
//! Numbers glued to a preceding ASCII letter (`Q3`, `H2O`, `v2`) are identifiers, not values.
//! Thousands separators are `,` followed by exactly three digits; full-width digits and signs
//! are understood; a leading `-` or `−` makes the number negative.
//!
//! ```
//! use flotilla_model::numeric::extract_numeric_value;
//! assert_eq!(extract_numeric_value("売上成長率は 15.3%"), Some(15.3));
//! assert_eq!(extract_numeric_value("net margin is 7.2%"), Some(7.2));
//! assert_eq!(extract_numeric_value("$1,234.5bn"), Some(1234.5));
//! assert_eq!(extract_numeric_value("no figures here"), None);
//! ```

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Salience {
    Plain,
    Currency,
    Percent,
}

/// Returns the salient number of `text`, or `None` when it has none.
pub fn extract_numeric_value(text: &str) -> Option<f64> {
    let chars: Vec<char> = text.chars().map(fold_width).collect();
    let mut best: Option<(Salience, f64)> = None;
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = i;
        // Identifiers such as Q3 or v2 are not values.
        let glued = start > 0 && chars[start - 1].is_ascii_alphabetic();
        let (value, end) = scan_number(&chars, start);
        i = end;
        if glued {
            continue;
        }
        let negative = start > 0
            && matches!(chars[start - 1], '-' | '−')
            && (start < 2 || !chars[start - 2].is_alphanumeric());
        let value = if negative { -value } else { value };
        let salience = classify(&chars, start, end);
        best = match best {
            // Percentages and currency: the first one wins. Plain numbers: the last one wins.
            Some((s, v)) if s > salience || (s == salience && s != Salience::Plain) => Some((s, v)),
            _ => Some((salience, value)),
        };
    }
    best.map(|(_, v)| v)
}

fn fold_width(c: char) -> char {
    match c {
        '０'..='９' => char::from_u32(c as u32 - '０' as u32 + '0' as u32).unwrap_or(c),
        '％' => '%',
        '．' => '.',
        '，' => ',',
        '－' => '-',
        '＄' => '$',
        _ => c,
    }
}

fn is_currency(c: char) -> bool {
    matches!(c, '$' | '€' | '£' | '¥' | '₹' | '￥' | '₩')
}

/// Scans digits with `,` thousands separators and one `.` decimal point.
fn scan_number(chars: &[char], start: usize) -> (f64, usize) {
    let mut text = String::new();
    let mut i = start;
    let mut seen_dot = false;
    while i < chars.len() {
        let c = chars[i];
        if c.is_ascii_digit() {
            text.push(c);
            i += 1;
        } else if c == ','
            && !seen_dot
            && chars
                .get(i + 1..i + 4)
                .is_some_and(|d| d.iter().all(char::is_ascii_digit))
            && !chars.get(i + 4).is_some_and(char::is_ascii_digit)
        {
            i += 1;
        } else if c == '.' && !seen_dot && chars.get(i + 1).is_some_and(char::is_ascii_digit) {
            seen_dot = true;
            text.push('.');
            i += 1;
        } else {
            break;
        }
    }
    (text.parse().unwrap_or(0.0), i)
}

fn classify(chars: &[char], start: usize, end: usize) -> Salience {
    let mut j = end;
    while j < chars.len() && chars[j] == ' ' {
        j += 1;
    }
    if chars.get(j) == Some(&'%') {
        return Salience::Percent;
    }
    let rest: String = chars[j..chars.len().min(j + 8)]
        .iter()
        .collect::<String>()
        .to_lowercase();
    if rest.starts_with("percent") || rest.starts_with("pct") {
        return Salience::Percent;
    }
    let mut k = start;
    while k > 0 && matches!(chars[k - 1], ' ' | '-' | '−') {
        k -= 1;
    }
    if k > 0 && is_currency(chars[k - 1]) {
        return Salience::Currency;
    }
    for code in ["usd", "eur", "gbp", "jpy", "円", "ドル"] {
        if rest.starts_with(code) {
            return Salience::Currency;
        }
    }
    Salience::Plain
}

#[cfg(test)]
mod tests {
    use super::extract_numeric_value as x;

    #[test]
    fn examples_from_the_design() {
        assert_eq!(x("売上成長率は 15.3%"), Some(15.3));
        assert_eq!(x("net margin is 7.2%"), Some(7.2));
        assert_eq!(x("$1,234.5bn"), Some(1234.5));
        assert_eq!(x("nothing to see"), None);
        assert_eq!(x(""), None);
    }

    #[test]
    fn percent_beats_everything_and_first_percent_wins() {
        assert_eq!(
            x("In Q3 2024 revenue grew 12% to $5.2bn, margin 8%"),
            Some(12.0)
        );
        assert_eq!(x("growth: 15.3 percent"), Some(15.3));
        assert_eq!(x("成長率は１５．３％です"), Some(15.3));
    }

    #[test]
    fn currency_beats_plain_numbers() {
        assert_eq!(x("Q3 2024 revenue was $5.2bn"), Some(5.2));
        assert_eq!(x("revenue 2024: 1200 USD"), Some(1200.0));
    }

    #[test]
    fn last_plain_number_and_identifiers() {
        assert_eq!(x("steps 1 and 2 give 42"), Some(42.0));
        assert_eq!(x("the answer is 42."), Some(42.0));
        assert_eq!(x("Q3 H2O v2"), None);
        assert_eq!(x("change of -3.5%"), Some(-3.5));
        assert_eq!(x("list 1,2,3"), Some(3.0));
        assert_eq!(x("total 1,234,567"), Some(1_234_567.0));
    }
}
