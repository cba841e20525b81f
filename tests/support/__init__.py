"""What tests in more than one directory share: writer processes, snapshot builders, a
scraper, certificates, an OTLP receiver, the endpoint picker's reading of a body."""
