"""The one Markdown table writer and the one CSV writer: the tuner's and the loader doctor's tables
on the console, the report's tables and every .csv dlojz writes."""
import csv


def markdown(headers, rows):
    """GitHub Markdown: a header line, its rule, one line per row of cells -> list of lines. A '|'
    in a cell would end it early: it is written '/'."""
    lines = ['| ' + ' | '.join(headers) + ' |', '|' + '---|' * len(headers)]
    return lines + ['| ' + ' | '.join(str(c).replace('|', '/') for c in row) + ' |' for row in rows]


def write_csv(path, columns, rows):
    """A CSV file with a header: rows are dicts (their keys outside `columns` left out) or
    sequences."""
    with open(path, 'w', newline='') as f:
        if rows and not isinstance(rows[0], dict):
            w = csv.writer(f)
            w.writerow(columns)
        else:
            w = csv.DictWriter(f, fieldnames=columns, extrasaction='ignore')
            w.writeheader()
        w.writerows(rows)
